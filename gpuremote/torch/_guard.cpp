// The gpuremote device's guard for more than one device index (gpuremote:0..k-1), and an
// empty-tensor factory that takes the index. PyTorch's Python backend API keeps one device:
// its guard answers index 0 and ignores setDevice, and its factory hardcodes index 0. This
// replaces the guard (C10_REGISTER_GUARD_IMPL stores it over the Python one when the library
// loads) with a thread-local current index and a device count set from Python; everything
// else of the device stays Python. It also gives the device the CPU's kernels of the views
// (metadata only, a new TensorImpl on the same storage: as_strided, view, _reshape_alias,
// unfold, view_as_real, view_as_complex; every other view is composed of these), which the
// Python fallback otherwise reaches by a round trip through Python for each; and, as a Python
// module, an eager op's call by its session's template: ``quick``, its arguments' template
// signature (``_encoding._quick``: ~0.75 us a tensor in Python), ``new_tensor``, a new
// buffer's storage and tensor (``_tensors.new_tensor``: 2.6 us in Python), and ``call``, the
// whole call (``Dispatcher._by_template``: signature, template, new tensors, post) from the
// device's Python fallback. Built by gpuremote/torch/_guard.py with torch's own
// cpp_extension (-O2) when the device is registered, cached per torch build, source and flags.
#include <torch/csrc/python_headers.h>
// (Python.h first)
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Layout.h>
#include <torch/csrc/MemoryFormat.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>

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
#include <ctime>

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

// ``quick(values, sig, places, floats, matter) -> bool``: gpuremote/torch/_encoding.py's
// ``_quick``, the same appends in the same order, in C: numbers, None, strings, dtypes, memory
// formats, layouts, tensors
// on this device (index 0, no lazy conj or neg bit) and lists or tuples of those; False at
// anything else (the caller then encodes the op whole). A tensor is its storage's handle
// (the fake address >> 32) and offset in bytes into ``places`` and (sizes, strides, dtype)
// into ``sig``; a float is its value into ``floats`` and ``float`` (then, where it matters,
// its value, NaN as ``nan_key``) into ``sig``; a bool ``true_key``/``false_key``. The keys
// are given once by ``keys(nan_key, true_key, false_key)``.
namespace {

PyObject* nan_key = nullptr;
PyObject* true_key = nullptr;
PyObject* false_key = nullptr;
PyObject* open_key = nullptr;  // "[" and "]": a list's bounds in the signature
PyObject* close_key = nullptr;

PyObject* int_tuple(c10::IntArrayRef values) {
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(values.size()));
  if (out == nullptr) return nullptr;
  for (size_t i = 0; i < values.size(); ++i) {
    PyObject* v = PyLong_FromLongLong(values[i]);
    if (v == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(i), v);
  }
  return out;
}

int append_new(PyObject* list, PyObject* item) {  // (steals item)
  if (item == nullptr) return -1;
  int rc = PyList_Append(list, item);
  Py_DECREF(item);
  return rc;
}

// 1: done; 0: not such an argument; -1: a Python error is set
int quick_tensor(PyObject* a, PyObject* sig, PyObject* places) {
  const at::Tensor& t = THPVariable_Unpack(a);
  if (!t.defined()) return 0;
  const auto device = t.device();
  if (device.type() != kType || device.index() > 0 || t.is_conj() || t.is_neg()) return 0;
  auto* impl = t.unsafeGetTensorImpl();
  if (impl->has_symbolic_sizes_strides() || !impl->has_storage()) return 0;
  const auto address = reinterpret_cast<uintptr_t>(impl->storage().data_ptr().get());
  if (append_new(places, PyLong_FromUnsignedLongLong(address >> 32)) < 0 ||
      append_new(places, PyLong_FromLongLong(impl->storage_offset() *
                                             static_cast<int64_t>(impl->itemsize()))) < 0)
    return -1;
  PyObject* sizes = int_tuple(impl->sizes());
  PyObject* strides = sizes ? int_tuple(impl->strides()) : nullptr;
  if (strides == nullptr) {
    Py_XDECREF(sizes);
    return -1;
  }
  PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()));
  Py_INCREF(dtype);
  PyObject* entry = PyTuple_New(3);
  if (entry == nullptr) {
    Py_DECREF(sizes);
    Py_DECREF(strides);
    Py_DECREF(dtype);
    return -1;
  }
  PyTuple_SET_ITEM(entry, 0, sizes);
  PyTuple_SET_ITEM(entry, 1, strides);
  PyTuple_SET_ITEM(entry, 2, dtype);
  return append_new(sig, entry) < 0 ? -1 : 1;
}

int quick_values(PyObject* values, PyObject* sig, PyObject* places, PyObject* floats,
                 bool matter) {
  PyObject** items = PySequence_Fast_ITEMS(values);  // (a list or a tuple: checked)
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(values);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* a = items[i];
    int rc = 1;
    if (a == Py_None || PyLong_CheckExact(a) || PyUnicode_CheckExact(a) || THPDtype_Check(a) ||
        THPMemoryFormat_Check(a) || THPLayout_Check(a)) {
      rc = PyList_Append(sig, a) < 0 ? -1 : 1;
    } else if (PyFloat_CheckExact(a)) {
      const double v = PyFloat_AS_DOUBLE(a);
      if (PyList_Append(floats, a) < 0 ||
          PyList_Append(sig, reinterpret_cast<PyObject*>(&PyFloat_Type)) < 0 ||
          (matter && PyList_Append(sig, v == v ? a : nan_key) < 0))
        rc = -1;
    } else if (PyBool_Check(a)) {
      rc = PyList_Append(sig, a == Py_True ? true_key : false_key) < 0 ? -1 : 1;
    } else if (THPVariable_Check(a)) {
      rc = quick_tensor(a, sig, places);
    } else if (PyList_CheckExact(a) || PyTuple_CheckExact(a)) {
      rc = PyList_Append(sig, open_key) < 0 ? -1 : quick_values(a, sig, places, floats, matter);
      if (rc == 1 && PyList_Append(sig, close_key) < 0) rc = -1;
    } else {
      rc = 0;
    }
    if (rc != 1) return rc;
  }
  return 1;
}

PyObject* py_quick(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5 || !(PyList_CheckExact(args[0]) || PyTuple_CheckExact(args[0])) ||
      !PyList_CheckExact(args[1]) || !PyList_CheckExact(args[2]) ||
      !PyList_CheckExact(args[3]) || nan_key == nullptr) {
    PyErr_SetString(PyExc_TypeError,
                    "quick(values: list | tuple, sig: list, places: list, floats: list, "
                    "matter: bool), after keys(...)");
    return nullptr;
  }
  int rc;
  try {
    rc = quick_values(args[0], args[1], args[2], args[3], PyObject_IsTrue(args[4]) == 1);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  if (rc < 0) return nullptr;
  return PyBool_FromLong(rc);
}

bool int_vector(PyObject* values, std::vector<int64_t>& out) {
  PyObject* fast = PySequence_Fast(values, "sizes and strides: a sequence of ints");
  if (fast == nullptr) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  out.resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    out[static_cast<size_t>(i)] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
    if (out[static_cast<size_t>(i)] == -1 && PyErr_Occurred()) {
      Py_DECREF(fast);
      return false;
    }
  }
  Py_DECREF(fast);
  return true;
}

// ``new_tensor(address, nbytes, sizes, strides, dtype, index) -> (tensor, storage)``: a
// storage of ``nbytes`` at fake address ``address`` on gpuremote:index (as PyTorch's
// ``_construct_storage_from_data_pointer`` makes it) and a tensor of ``sizes``, ``strides``
// and ``dtype`` over it at offset 0 (as ``set_`` makes it, after its check that the tensor
// lies within the storage's bytes): ``_tensors.new_tensor``'s two objects in one call.
PyObject* py_new_tensor(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6 || !PyLong_Check(args[0]) || !PyLong_Check(args[1]) ||
      !THPDtype_Check(args[4]) || !PyLong_Check(args[5])) {
    PyErr_SetString(PyExc_TypeError,
                    "new_tensor(address: int, nbytes: int, sizes, strides, dtype, index: int)");
    return nullptr;
  }
  const auto address = PyLong_AsUnsignedLongLong(args[0]);
  const auto nbytes = PyLong_AsLongLong(args[1]);
  const auto index = PyLong_AsLong(args[5]);
  std::vector<int64_t> sizes, strides;
  if (PyErr_Occurred() || !int_vector(args[2], sizes) || !int_vector(args[3], strides))
    return nullptr;
  const auto dtype = reinterpret_cast<THPDtype*>(args[4])->scalar_type;
  try {
    TORCH_CHECK(nbytes >= 0 && index >= 0 && index < device_count.load(),
                "new_tensor: no such storage (", nbytes, " bytes on index ", index, ")");
    TORCH_CHECK(sizes.size() == strides.size(), "new_tensor: ", sizes.size(), " sizes, ",
                strides.size(), " strides");
    const auto itemsize = static_cast<int64_t>(c10::elementSize(dtype));
    int64_t extent = 1;  // (the bytes the view reaches: set_'s check)
    bool empty = false;
    for (size_t i = 0; i < sizes.size(); ++i) {
      TORCH_CHECK(sizes[i] >= 0 && strides[i] >= 0, "new_tensor: negative size or stride");
      empty = empty || sizes[i] == 0;
      extent += (sizes[i] - 1) * strides[i];
    }
    TORCH_CHECK(empty || extent * itemsize <= nbytes, "new_tensor: a tensor of ",
                extent * itemsize, " bytes beyond its storage's ", nbytes);
    c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<size_t>(nbytes),
                         c10::DataPtr(reinterpret_cast<void*>(address),
                                      device(static_cast<c10::DeviceIndex>(index))));
    auto tensor = at::detail::make_tensor<c10::TensorImpl>(
        c10::Storage(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
        caffe2::TypeMeta::fromScalarType(dtype));
    tensor.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, 0);
    PyObject* py_tensor = THPVariable_Wrap(std::move(tensor));
    if (py_tensor == nullptr) return nullptr;
    PyObject* py_storage = THPStorage_Wrap(std::move(storage));
    if (py_storage == nullptr) {
      Py_DECREF(py_tensor);
      return nullptr;
    }
    PyObject* out = PyTuple_New(2);
    if (out == nullptr) {
      Py_DECREF(py_tensor);
      Py_DECREF(py_storage);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, 0, py_tensor);
    PyTuple_SET_ITEM(out, 1, py_storage);
    return out;
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// ``call(ctx, op, args, kwargs)``: an eager op's call by its session's template, whole, as
// gpuremote/torch/_dispatch.py's ``Dispatcher._by_template`` makes it (``run``'s first step):
// ``ctx[0]`` (``MISS``) where it is not such a call, and ``run`` goes its own way. ``ctx``:
// [MISS, plans: {op: (plan, returns, floats matter, argument position, argument name)} for
// the ops that may go so, the dispatcher's drivers, the ATen call's spec, the live storages
// and their finalizer (``_tensors._LIVE``, ``_died``), the memory stats by index]; a driver's
// ``native_calls``: (its templates, its session's ``new_handle``, its ``_release``, its
// posts, its batching policy, its ``_posted_more``). ``returns``: 0 one new tensor, 1 an
// argument (position, name), 2 nothing, 3 as ``ctx[8]`` (``Dispatcher._result``) says.
enum CtxSlot { kMiss, kPlans, kDrivers, kSpec, kLive, kDied, kStats, kZero, kResult, kCtxSize };

// the attribute names ``call`` reads, interned once (``PyInit_gpuremote_guard``)
PyObject *allocated_key, *peak_key, *closed_key, *recording_key, *native_key, *direct_key,
    *first_post_key, *append_key, *post_batch_key, *delay_key, *dozing_key, *woken_key;
const struct {
  PyObject** key;
  const char* name;
} kNames[] = {{&allocated_key, "allocated"},   {&peak_key, "peak"},
              {&closed_key, "closed"},         {&recording_key, "recording"},
              {&native_key, "native_calls"},   {&direct_key, "direct"},
              {&first_post_key, "_first_post"}, {&append_key, "append"},
              {&post_batch_key, "post_batch"}, {&delay_key, "delay_s"},
              {&dozing_key, "_dozing"},        {&woken_key, "_woken"}};
PyObject* thirty_two = nullptr;

PyObject* new_remote(PyObject* handle, PyObject* meta, PyObject* release, PyObject* live,
                     PyObject* died, PyObject* stats, PyObject* zero) {
  // meta: (sizes, strides, dtype, nbytes)
  if (!PyTuple_Check(meta) && !PyList_Check(meta)) {
    PyErr_SetString(PyExc_TypeError, "call: an output's metadata is not a sequence");
    return nullptr;
  }
  PyObject* nbytes = PySequence_GetItem(meta, 3);
  PyObject* sizes = PySequence_GetItem(meta, 0);
  PyObject* strides = PySequence_GetItem(meta, 1);
  PyObject* dtype = PySequence_GetItem(meta, 2);
  PyObject* address = PyNumber_Lshift(handle, thirty_two);  // (the fake address)
  PyObject* out = nullptr;
  PyObject* made = nullptr;
  if (nbytes && sizes && strides && dtype && address) {
    PyObject* shift_args[6] = {address, nbytes, sizes, strides, dtype, zero};
    made = py_new_tensor(nullptr, shift_args, 6);
  }
  if (made != nullptr) {
    PyObject* storage = PyTuple_GET_ITEM(made, 1);
    PyObject* ref = PyWeakref_NewRef(storage, died);
    PyObject* entry = ref ? PyTuple_Pack(4, release, handle, nbytes, zero) : nullptr;
    int rc = entry ? PyDict_SetItem(live, ref, entry) : -1;
    Py_XDECREF(ref);
    Py_XDECREF(entry);
    if (rc == 0) {  // the stats: allocated += nbytes, peak = max(peak, allocated)
      PyObject* was = PyObject_GetAttr(stats, allocated_key);
      PyObject* now = was ? PyNumber_Add(was, nbytes) : nullptr;
      Py_XDECREF(was);
      PyObject* peak = now ? PyObject_GetAttr(stats, peak_key) : nullptr;
      int higher = peak ? PyObject_RichCompareBool(now, peak, Py_GT) : -1;
      if (higher >= 0 && PyObject_SetAttr(stats, allocated_key, now) == 0 &&
          (!higher || PyObject_SetAttr(stats, peak_key, now) == 0)) {
        out = PyTuple_GET_ITEM(made, 0);
        Py_INCREF(out);
      }
      Py_XDECREF(now);
      Py_XDECREF(peak);
    }
    Py_DECREF(made);
  }
  Py_XDECREF(nbytes);
  Py_XDECREF(sizes);
  Py_XDECREF(strides);
  Py_XDECREF(dtype);
  Py_XDECREF(address);
  return out;
}

double perf_counter() {  // (time.perf_counter's clock)
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// ``SyncDriver.post`` of (spec, 0, call_args), for a driver that records nothing and does
// not run calls where they are made (checked by the caller): appended to its posts, their
// age and count against its batching policy; what follows where they are due (or the
// helper dozes) is the driver's ``_posted_more``. 1, or -1 with a Python error set.
int post(PyObject* d, PyObject* native, PyObject* spec, PyObject* zero, PyObject* call_args) {
  PyObject* posted = PyTuple_GET_ITEM(native, 3);
  PyObject* policy = PyTuple_GET_ITEM(native, 4);
  const Py_ssize_t before = PyObject_Size(posted);
  if (before < 0) return -1;
  const double now = perf_counter();
  if (before == 0) {
    PyObject* first = PyFloat_FromDouble(now);
    const int set = first ? PyObject_SetAttr(d, first_post_key, first) : -1;
    Py_XDECREF(first);
    if (set < 0) return -1;
  }
  PyObject* item = PyTuple_Pack(4, spec, zero, call_args, Py_None);
  PyObject* appended = item ? PyObject_CallMethodOneArg(posted, append_key, item) : nullptr;
  Py_XDECREF(item);
  if (appended == nullptr) return -1;
  Py_DECREF(appended);
  const Py_ssize_t n = before + 1;
  PyObject* batch = PyObject_GetAttr(policy, post_batch_key);
  PyObject* delay = batch ? PyObject_GetAttr(policy, delay_key) : nullptr;
  PyObject* first = delay ? PyObject_GetAttr(d, first_post_key) : nullptr;
  PyObject* dozing = first ? PyObject_GetAttr(d, dozing_key) : nullptr;
  PyObject* woken = dozing ? PyObject_GetAttr(d, woken_key) : nullptr;
  int rc = woken ? 1 : -1;
  if (rc == 1) {
    const long long most = PyLong_AsLongLong(batch);
    const double wait_s = PyFloat_AsDouble(delay);
    const double oldest = PyFloat_AsDouble(first);
    if (PyErr_Occurred()) {
      rc = -1;
    } else {
      const bool due = n >= most || now - oldest >= wait_s;
      if (due || (dozing == Py_True && woken == Py_False)) {
        PyObject* more = PyObject_CallFunction(PyTuple_GET_ITEM(native, 5), "nO", n,
                                               due ? Py_True : Py_False);
        if (more == nullptr) rc = -1;
        Py_XDECREF(more);
      }
    }
  }
  Py_XDECREF(batch);
  Py_XDECREF(delay);
  Py_XDECREF(first);
  Py_XDECREF(dozing);
  Py_XDECREF(woken);
  return rc;
}

// a new reference to ctx[kMiss]
PyObject* miss(PyObject* ctx) {
  PyObject* m = PyList_GET_ITEM(ctx, kMiss);
  Py_INCREF(m);
  return m;
}

PyObject* py_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyList_CheckExact(args[0]) || PyList_GET_SIZE(args[0]) != kCtxSize ||
      !PyTuple_CheckExact(args[2]) || !PyDict_CheckExact(args[3]) || nan_key == nullptr) {
    PyErr_SetString(PyExc_TypeError, "call(ctx: list, op, args: tuple, kwargs: dict)");
    return nullptr;
  }
  PyObject* ctx = args[0];
  PyObject* kwargs = args[3];
  PyObject* entry = PyDict_GetItemWithError(PyList_GET_ITEM(ctx, kPlans), args[1]);
  if (entry == nullptr) return PyErr_Occurred() ? nullptr : miss(ctx);
  PyObject* drivers = PyList_GET_ITEM(ctx, kDrivers);
  if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 5 || !PyDict_CheckExact(drivers) ||
      PyDict_GET_SIZE(drivers) != 1)
    return miss(ctx);
  PyObject* d = PyDict_GetItemWithError(drivers, PyList_GET_ITEM(ctx, kZero));
  if (d == nullptr) return PyErr_Occurred() ? nullptr : miss(ctx);
  PyObject* stats =
      PyDict_GetItemWithError(PyList_GET_ITEM(ctx, kStats), PyList_GET_ITEM(ctx, kZero));
  if (stats == nullptr) return PyErr_Occurred() ? nullptr : miss(ctx);
  // the driver: open, recording nothing, its bound methods cached
  PyObject* native = PyObject_GetAttr(d, native_key);
  if (native == nullptr) return nullptr;
  PyObject* closed = PyObject_GetAttr(d, closed_key);
  PyObject* recording = closed ? PyObject_GetAttr(d, recording_key) : nullptr;
  PyObject* direct = recording ? PyObject_GetAttr(d, direct_key) : nullptr;
  const bool usable = direct != nullptr && closed == Py_False && recording == Py_None &&
                      direct == Py_False && PyTuple_CheckExact(native) &&
                      PyTuple_GET_SIZE(native) == 6;
  Py_XDECREF(closed);
  Py_XDECREF(recording);
  Py_XDECREF(direct);
  if (!usable) {
    Py_DECREF(native);
    return PyErr_Occurred() ? nullptr : miss(ctx);
  }
  PyObject* plan = PyTuple_GET_ITEM(entry, 0);
  const long returns = PyLong_AsLong(PyTuple_GET_ITEM(entry, 1));
  const bool matter = PyTuple_GET_ITEM(entry, 2) == Py_True;
  PyObject* result = nullptr;
  PyObject* sig = PyList_New(0);
  PyObject* places = PyList_New(0);
  PyObject* floats = PyList_New(0);
  PyObject* outputs = nullptr;
  PyObject* handles = nullptr;
  PyObject* key = nullptr;
  PyObject* held = nullptr;  // the template's entry
  int rc = (sig && places && floats) ? 1 : -1;
  try {
    if (rc == 1) rc = quick_values(args[2], sig, places, floats, matter);
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (rc == 1 && PyDict_Next(kwargs, &pos, &k, &v)) {  // (as ``quick_signature``)
      if (PyList_Append(sig, k) < 0) {
        rc = -1;
        break;
      }
      PyObject* one = PyTuple_Pack(1, v);
      rc = one ? quick_values(one, sig, places, floats, matter) : -1;
      Py_XDECREF(one);
    }
    PyObject* kept = nullptr;
    if (rc == 1) {
      PyObject* sig_tuple = PyList_AsTuple(sig);
      key = sig_tuple ? PyTuple_Pack(2, plan, sig_tuple) : nullptr;
      Py_XDECREF(sig_tuple);
      kept = key ? PyDict_GetItemWithError(PyTuple_GET_ITEM(native, 0), key) : nullptr;
      if (kept == nullptr) rc = (key == nullptr || PyErr_Occurred()) ? -1 : 0;
      // held: the Python called below (new handles, the post) may drop it from the dict
      Py_XINCREF(kept);
      held = kept;
    }
    // kept: (template, (news, resized, counts))
    PyObject* news = nullptr;
    PyObject* counts = nullptr;
    if (rc == 1) {
      PyObject* metas = PyTuple_Check(kept) && PyTuple_GET_SIZE(kept) == 2
                            ? PyTuple_GET_ITEM(kept, 1) : nullptr;
      if (metas == nullptr || !PyTuple_Check(metas) || PyTuple_GET_SIZE(metas) != 3) {
        rc = 0;
      } else {
        news = PyTuple_GET_ITEM(metas, 0);
        counts = PyTuple_GET_ITEM(metas, 2);
        if (!PyList_Check(news) && !PyTuple_Check(news)) rc = 0;
      }
    }
    if (rc == 1) {  // the outputs, each a new buffer's tensor
      const Py_ssize_t n = PySequence_Size(news);
      outputs = PyList_New(0);
      handles = PyList_New(0);
      if (outputs == nullptr || handles == nullptr) rc = -1;
      for (Py_ssize_t i = 0; rc == 1 && i < n; ++i) {
        PyObject* meta = PySequence_GetItem(news, i);
        if (meta == nullptr) {
          rc = -1;
        } else if (meta == Py_None) {
          rc = PyList_Append(outputs, Py_None) < 0 ? -1 : 1;
        } else {
          PyObject* handle = PyObject_CallNoArgs(PyTuple_GET_ITEM(native, 1));
          PyObject* t = handle ? new_remote(handle, meta, PyTuple_GET_ITEM(native, 2),
                                            PyList_GET_ITEM(ctx, kLive),
                                            PyList_GET_ITEM(ctx, kDied), stats,
                                            PyList_GET_ITEM(ctx, kZero))
                               : nullptr;
          rc = (t && PyList_Append(outputs, t) == 0 && PyList_Append(handles, handle) == 0)
                   ? 1 : -1;
          Py_XDECREF(t);
          Py_XDECREF(handle);
        }
        Py_XDECREF(meta);
      }
    }
    if (rc == 1) {  // posted: [template, places, handles, floats]
      PyObject* call_args = PyList_New(4);
      if (call_args == nullptr) {
        rc = -1;
      } else {
        PyObject* template_ = PyTuple_GET_ITEM(kept, 0);
        Py_INCREF(template_);
        Py_INCREF(places);
        Py_INCREF(handles);
        Py_INCREF(floats);
        PyList_SET_ITEM(call_args, 0, template_);
        PyList_SET_ITEM(call_args, 1, places);
        PyList_SET_ITEM(call_args, 2, handles);
        PyList_SET_ITEM(call_args, 3, floats);
        rc = post(d, native, PyList_GET_ITEM(ctx, kSpec), PyList_GET_ITEM(ctx, kZero),
                  call_args);
        Py_DECREF(call_args);
      }
    }
    if (rc == 1) {  // the op's result
      const bool one = PyList_Check(counts) && PyList_GET_SIZE(counts) == 1 &&
                       PyLong_Check(PyList_GET_ITEM(counts, 0)) &&
                       PyLong_AsLong(PyList_GET_ITEM(counts, 0)) == -1 &&
                       PyList_GET_SIZE(outputs) == 1;
      if (returns == 0 && one) {
        result = PyList_GET_ITEM(outputs, 0);
        Py_INCREF(result);
      } else if (returns == 1) {
        const Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 3));
        if (at >= 0 && at < PyTuple_GET_SIZE(args[2])) {
          result = PyTuple_GET_ITEM(args[2], at);
          Py_INCREF(result);
        } else {
          result = PyDict_GetItemWithError(kwargs, PyTuple_GET_ITEM(entry, 4));
          if (result != nullptr) {
            Py_INCREF(result);
          } else if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_KeyError, "call: the returned argument is missing");
          }
        }
      } else if (returns == 2) {
        result = Py_None;
        Py_INCREF(result);
      } else {
        PyObject* it = PyObject_GetIter(outputs);
        PyObject* result_args[5] = {plan, args[2], kwargs, it, counts};
        result = it ? PyObject_Vectorcall(PyList_GET_ITEM(ctx, kResult), result_args, 5,
                                          nullptr)
                    : nullptr;
        Py_XDECREF(it);
      }
      if (result == nullptr) rc = -1;
    }
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    rc = -1;
  }
  Py_DECREF(native);  // (it holds the driver: its bound methods)
  Py_XDECREF(held);
  Py_XDECREF(sig);
  Py_XDECREF(places);
  Py_XDECREF(floats);
  Py_XDECREF(outputs);
  Py_XDECREF(handles);
  Py_XDECREF(key);
  if (rc < 0) {
    Py_XDECREF(result);
    return nullptr;
  }
  if (rc == 0) return miss(ctx);
  return result;
}

PyObject* py_keys(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "keys(nan_key, true_key, false_key)");
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < 3; ++i) Py_INCREF(args[i]);
  Py_XSETREF(nan_key, args[0]);
  Py_XSETREF(true_key, args[1]);
  Py_XSETREF(false_key, args[2]);
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"quick", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_quick)),
     METH_FASTCALL, "An op's arguments to their template signature (see _encoding._quick)."},
    {"new_tensor", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_new_tensor)),
     METH_FASTCALL, "A remote buffer's storage and a tensor over it (see _tensors.new_tensor)."},
    {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_call)),
     METH_FASTCALL, "An eager op's call by its session's template (see Dispatcher.run)."},
    {"keys", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_keys)),
     METH_FASTCALL, "The signature's keys for NaN, True and False."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpuremote_guard", nullptr, -1, methods,
                      nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit_gpuremote_guard() {
  open_key = PyUnicode_InternFromString("[");
  close_key = PyUnicode_InternFromString("]");
  for (const auto& name : kNames) {
    *name.key = PyUnicode_InternFromString(name.name);
    if (*name.key == nullptr) return nullptr;
  }
  thirty_two = PyLong_FromLong(32);
  if (open_key == nullptr || close_key == nullptr || thirty_two == nullptr) return nullptr;
  return PyModule_Create(&module);
}
