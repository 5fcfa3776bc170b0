// The gpuremote device's guard for more than one device index (gpuremote:0..k-1), and an
// empty-tensor factory that takes the index. PyTorch's Python backend API keeps one device:
// its guard answers index 0 and ignores setDevice, and its factory hardcodes index 0. This
// replaces the guard (C10_REGISTER_GUARD_IMPL stores it over the Python one when the library
// loads) with a thread-local current index and a device count set from Python; everything
// else of the device stays Python. It also gives the device the CPU's kernels of the views
// (metadata only, a new TensorImpl on the same storage: as_strided, view, _reshape_alias,
// unfold, view_as_real, view_as_complex; every other view is composed of these), which the
// Python fallback otherwise reaches by a round trip through Python for each. Built by
// gpuremote/torch/_guard.py with torch's own cpp_extension when the device is registered,
// cached per torch build and source.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/Storage.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <atomic>

namespace {

constexpr auto kType = c10::DeviceType::PrivateUse1;
thread_local c10::DeviceIndex current_index = 0;
std::atomic<c10::DeviceIndex> device_count{1};

c10::Device device(c10::DeviceIndex index) { return c10::Device(kType, index); }

struct Guard final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kType; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = device(current_index);
    current_index = d.index();
    return old;
  }
  c10::Device getDevice() const override { return device(current_index); }
  void setDevice(c10::Device d) const override { current_index = d.index(); }
  void uncheckedSetDevice(c10::Device d) const noexcept override { current_index = d.index(); }
  // one stream per device: the session runs its ops in the order they were sent
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    return c10::Stream(c10::Stream::DEFAULT, s.device());
  }
  c10::DeviceIndex deviceCount() const noexcept override { return device_count.load(); }
  // Events order nothing here: on one device, every op runs in the order sent (one stream);
  // between devices, data moves only by a copy that waits for its source (peer_export is
  // synchronous) and is queued in order on its target. Autograd records and waits for
  // events where a gradient crosses devices: these are those events, already complete.
  void record(void** event, const c10::Stream&, const c10::DeviceIndex,
              const c10::EventFlag) const override {
    static int recorded = 0;
    *event = &recorded;
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard);

// A tensor of no elements on gpuremote:index (then set_ to a remote storage).
at::Tensor empty_on(int64_t index, at::ScalarType dtype) {
  c10::Storage storage(
      c10::Storage::use_byte_size_t(), 0,
      c10::DataPtr(nullptr, device(static_cast<c10::DeviceIndex>(index))), nullptr, false);
  return at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      caffe2::TypeMeta::fromScalarType(dtype));
}

int64_t set_device_count(int64_t n) {
  device_count = static_cast<c10::DeviceIndex>(n);
  return n;
}

int64_t get_device_count() { return device_count.load(); }

int64_t current_device() { return current_index; }

int64_t set_device(int64_t index) {
  auto old = current_index;
  current_index = static_cast<c10::DeviceIndex>(index);
  return old;
}

// Point the storage at ``cdata`` (a c10::StorageImpl*, Python's ``storage._cdata``) at the
// remote buffer whose fake address is ``address``, of ``nbytes``: a storage's resize (FSDP
// frees an unsharded parameter's memory by resize_(0) and gets it back by resize_(n)), which
// PyTorch otherwise asks of a device's C++ hooks. Its views keep the storage, so they see
// the new buffer.
int64_t set_storage(int64_t cdata, int64_t address, int64_t nbytes, int64_t index) {
  auto* impl = reinterpret_cast<c10::StorageImpl*>(cdata);
  impl->set_data_ptr_noswap(c10::DataPtr(
      reinterpret_cast<void*>(address), device(static_cast<c10::DeviceIndex>(index))));
  impl->set_nbytes(static_cast<size_t>(nbytes));
  return nbytes;
}

// The views, as the CPU's kernels make them (the Python fallback redispatches them there):
// the same checks (the view within its storage's bytes), nothing sent to the proxy.
at::Tensor as_strided(const at::Tensor& self, c10::SymIntArrayRef size,
                      c10::SymIntArrayRef stride, std::optional<c10::SymInt> offset) {
  return at::native::as_strided_tensorimpl(
      self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride),
      offset ? std::optional<int64_t>(offset->expect_int()) : std::nullopt);
}

at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

at::Tensor reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size,
                         c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size),
                                    C10_AS_INTARRAYREF_SLOW(stride));
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("as_strided", TORCH_FN(as_strided));
  m.impl("view", TORCH_FN(view));
  m.impl("_reshape_alias", TORCH_FN(reshape_alias));
  m.impl("unfold", TORCH_FN(at::native::unfold));
  m.impl("view_as_real", TORCH_FN(at::native::view_as_real));
  m.impl("view_as_complex", TORCH_FN(at::native::view_as_complex));
}

TORCH_LIBRARY(gpuremote_guard, m) {
  m.def("empty_on", &empty_on);
  m.def("set_device_count", &set_device_count);
  m.def("device_count", &get_device_count);
  m.def("current_device", &current_device);
  m.def("set_device", &set_device);
  m.def("set_storage", &set_storage);
}
