// The gpuremote device's guard for more than one device index (gpuremote:0..k-1), and an
// empty-tensor factory that takes the index. PyTorch's Python backend API keeps one device:
// its guard answers index 0 and ignores setDevice, and its factory hardcodes index 0. This
// replaces the guard (C10_REGISTER_GUARD_IMPL stores it over the Python one when the library
// loads) with a thread-local current index and a device count set from Python; everything
// else of the device stays Python. It also gives the device the CPU's kernels of the views
// (metadata only, a new TensorImpl on the same storage: as_strided, view, _reshape_alias,
// unfold, view_as_real, view_as_complex; every other view is composed of these), which the
// Python fallback otherwise reaches by a round trip through Python for each; and, as a Python
// module, two steps of an eager op's call: ``quick``, its arguments' template signature
// (``_encoding._quick``: ~0.75 us a tensor in Python), and ``new_tensor``, a new buffer's
// storage and tensor (``_tensors.new_tensor``: 2.6 us in Python). Built by
// gpuremote/torch/_guard.py with torch's own cpp_extension when the device is registered,
// cached per torch build and source.
#include <torch/csrc/python_headers.h>
// (Python.h first)
#include <torch/csrc/Dtype.h>
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
// ``_quick``, the same appends in the same order, in C: numbers, None, strings, dtypes, tensors
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
    if (a == Py_None || PyLong_CheckExact(a) || PyUnicode_CheckExact(a) || THPDtype_Check(a)) {
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
    {"keys", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_keys)),
     METH_FASTCALL, "The signature's keys for NaN, True and False."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpuremote_guard", nullptr, -1, methods,
                      nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit_gpuremote_guard() {
  open_key = PyUnicode_InternFromString("[");
  close_key = PyUnicode_InternFromString("]");
  if (open_key == nullptr || close_key == nullptr) return nullptr;
  return PyModule_Create(&module);
}
