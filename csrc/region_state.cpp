#include "region_state.h"

#include "op_override.h"

#include <ATen/autocast_mode.h>
#include <c10/core/DefaultDtype.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstring>

namespace py = pybind11;

namespace aoti_eager {
namespace {

// The first word of each argument in a key.
enum Tag : int64_t { kNone = 1, kFalse, kTrue, kInt, kFloat, kString, kTensor, kTuple, kList, kDict, kOpaque };

// How deep tuples, lists and dicts are keyed (a list may hold itself).
constexpr int kMaxDepth = 8;

void append(std::string& key, int64_t word) {
  key.append(reinterpret_cast<const char*>(&word), sizeof(word));
}

// A tensor's words: what a region's kernel is compiled for (as
// kernels/signature.py's TensorArg describes it) and requires_grad. False
// for a tensor that the slow path must look at (a layout, a lazy view, a
// subclass, a device other than CPU and CUDA).
bool append_tensor(std::string& key, const at::Tensor& t) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (!t.defined() || t.layout() != at::kStrided || t.is_conj() || t.is_neg() || impl->is_python_dispatch() ||
      impl->is_wrapped_number() || impl->has_symbolic_sizes_strides() || !t.has_storage()) {
    return false;
  }
  const c10::Device device = impl->device();
  if (!device.is_cpu() && !device.is_cuda()) {
    return false;
  }
  const auto sizes = impl->sizes();
  const bool aligned = reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
  append(key, kTensor | static_cast<int64_t>(t.scalar_type()) << 8 |
      static_cast<int64_t>(static_cast<uint8_t>(device.type())) << 16 |
      static_cast<int64_t>(static_cast<uint8_t>(device.index())) << 24 |
      static_cast<int64_t>(sizes.size()) << 32 | static_cast<int64_t>(aligned) << 48 |
      static_cast<int64_t>(t.requires_grad()) << 49);
  for (int64_t size : sizes) {
    append(key, size);
  }
  for (int64_t stride : impl->strides()) {
    append(key, stride);
  }
  return true;
}

bool append_string(std::string& key, PyObject* s) {
  Py_ssize_t size = 0;
  const char* data = PyUnicode_AsUTF8AndSize(s, &size);
  if (data == nullptr) {
    PyErr_Clear(); // a string with lone surrogates: the slow path describes it
    return false;
  }
  append(key, kString);
  append(key, size);
  key.append(data, size);
  return true;
}

// Whether no region call can take `v` (kernels/region.py's RegionCall
// refuses it): a value that is none of a tensor, a number, a string or None,
// and no pytree node that the slow path would flatten into such values.
bool opaque(PyObject* v, PyObject* nodes) {
  return v != Py_None && !PyLong_Check(v) && !PyFloat_Check(v) && !PyUnicode_Check(v) && !PyTuple_Check(v) &&
      !THPVariable_Check(v) && PyDict_Contains(nodes, reinterpret_cast<PyObject*>(Py_TYPE(v))) == 0;
}

bool append_value(std::string& key, PyObject* v, PyObject* nodes, int depth);

// A tuple's, list's or dict's words (tag, size, then each item; a dict's
// keys must be strings), in the order pytree flattens them.
bool append_container(std::string& key, PyObject* v, PyObject* nodes, int depth) {
  if (depth >= kMaxDepth) {
    return false;
  }
  if (PyTuple_CheckExact(v) || PyList_CheckExact(v)) {
    const bool tuple = PyTuple_CheckExact(v);
    const Py_ssize_t size = tuple ? PyTuple_GET_SIZE(v) : PyList_GET_SIZE(v);
    append(key, tuple ? kTuple : kList);
    append(key, size);
    for (Py_ssize_t i = 0; i < size; ++i) {
      if (!append_value(key, tuple ? PyTuple_GET_ITEM(v, i) : PyList_GET_ITEM(v, i), nodes, depth + 1)) {
        return false;
      }
    }
    return true;
  }
  append(key, kDict);
  append(key, PyDict_GET_SIZE(v));
  PyObject* name = nullptr;
  PyObject* value = nullptr;
  Py_ssize_t position = 0;
  while (PyDict_Next(v, &position, &name, &value)) {
    if (!PyUnicode_CheckExact(name) || !append_string(key, name) || !append_value(key, value, nodes, depth + 1)) {
      return false;
    }
  }
  return true;
}

// One argument's words; false for a value the key does not take (the slow
// path flattens it). A value no region call takes is keyed by its type alone:
// its calls all run eagerly, decided once.
bool append_value(std::string& key, PyObject* v, PyObject* nodes, int depth) {
  if (v == Py_None) {
    append(key, kNone);
  } else if (PyBool_Check(v)) {
    append(key, v == Py_True ? kTrue : kFalse);
  } else if (PyLong_CheckExact(v)) {
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow != 0 || (value == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
    append(key, kInt);
    append(key, value);
  } else if (PyFloat_CheckExact(v)) {
    const double value = PyFloat_AS_DOUBLE(v);
    int64_t bits = 0;
    std::memcpy(&bits, &value, sizeof(bits)); // -0.0 and 0.0 apart, as the slow path's repr()
    append(key, kFloat);
    append(key, bits);
  } else if (PyUnicode_CheckExact(v)) {
    return append_string(key, v);
  } else if (THPVariable_CheckExact(v)) {
    return append_tensor(key, THPVariable_Unpack(v));
  } else if (PyTuple_CheckExact(v) || PyList_CheckExact(v) || PyDict_CheckExact(v)) {
    return append_container(key, v, nodes, depth);
  } else if (opaque(v, nodes)) {
    append(key, kOpaque);
    append(key, reinterpret_cast<intptr_t>(Py_TYPE(v)));
  } else {
    return false;
  }
  return true;
}

// Calls `fn` with each tensor of `v`, in the order pytree flattens it.
template <typename F>
void for_each_tensor(PyObject* v, F&& fn) {
  if (THPVariable_Check(v)) {
    fn(v);
  } else if (PyTuple_CheckExact(v)) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(v); ++i) {
      for_each_tensor(PyTuple_GET_ITEM(v, i), fn);
    }
  } else if (PyList_CheckExact(v)) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(v); ++i) {
      for_each_tensor(PyList_GET_ITEM(v, i), fn);
    }
  } else if (PyDict_CheckExact(v)) {
    PyObject* name = nullptr;
    PyObject* value = nullptr;
    Py_ssize_t position = 0;
    while (PyDict_Next(v, &position, &name, &value)) {
      for_each_tensor(value, fn);
    }
  }
}

// Calls `fn` with each tensor of a call: `args`' items, then `kwargs`' values.
template <typename F>
void for_each_argument(py::handle args, py::handle kwargs, F&& fn) {
  for_each_tensor(args.ptr(), fn);
  for_each_tensor(kwargs.ptr(), fn);
}

// Writes the state's words and data pointers into `key`; false where a
// tensor is one the key does not take.
bool fingerprint(const std::vector<at::Tensor>& tensors, std::string& key) {
  key.clear();
  for (const at::Tensor& t : tensors) {
    if (!append_tensor(key, t)) {
      return false;
    }
    append(key, reinterpret_cast<intptr_t>(t.const_data_ptr()));
  }
  return true;
}

} // namespace

RegionState::RegionState(
    std::vector<at::Tensor> tensors,
    std::vector<std::tuple<py::dict, py::str, py::object>> values,
    std::vector<py::dict> sized)
    : tensors_(std::move(tensors)), values_(std::move(values)) {
  for (py::dict& d : sized) {
    const Py_ssize_t size = PyDict_Size(d.ptr());
    sized_.emplace_back(std::move(d), size);
  }
  std::string key;
  if (fingerprint(tensors_, key)) {
    fingerprint_ = std::move(key);
  }
}

bool RegionState::unchanged() const {
  return tensors_unchanged() && values_unchanged();
}

bool RegionState::tensors_unchanged() const {
  if (!fingerprint_.has_value()) {
    return false;
  }
  for (const auto& [mapping, size] : sized_) {
    if (PyDict_GET_SIZE(mapping.ptr()) != size) {
      return false;
    }
  }
  // Written into the thread's buffer: no allocation per call.
  static thread_local std::string now;
  return fingerprint(tensors_, now) && now == *fingerprint_;
}

bool RegionState::values_unchanged() const {
  for (const auto& [mapping, name, value] : values_) {
    // Borrowed, compared by identity: a value assigned anew is another object.
    if (PyDict_GetItemWithError(mapping.ptr(), name.ptr()) != value.ptr()) {
      PyErr_Clear();
      return false;
    }
  }
  return true;
}

std::optional<std::string> RegionState::key(py::handle args, py::handle kwargs, py::handle nodes) {
  std::string key;
  key.reserve(256);
  const at::DeviceType autocast_devices[] = {at::kCPU, at::kCUDA};
  int64_t header = static_cast<int64_t>(c10::GradMode::is_enabled()) |
      static_cast<int64_t>(c10::typeMetaToScalarType(c10::get_default_dtype())) << 8;
  for (size_t i = 0; i < 2; ++i) {
    if (at::autocast::is_autocast_enabled(autocast_devices[i])) {
      // Autocast on the device, and the dtype it casts to.
      header |= (int64_t{1} << (1 + i)) |
          static_cast<int64_t>(at::autocast::get_autocast_dtype(autocast_devices[i])) << (16 + 8 * i);
    }
  }
  append(key, header);
  if (!append_value(key, args.ptr(), nodes.ptr(), 0) || !append_value(key, kwargs.ptr(), nodes.ptr(), 0)) {
    return std::nullopt;
  }
  return key;
}

namespace {

PyObject* lookup(py::handle dict, const py::bytes& name) {
  PyObject* found = PyDict_GetItemWithError(dict.ptr(), name.ptr()); // borrowed
  if (found == nullptr) {
    PyErr_Clear();
  }
  return found;
}

} // namespace

PyObject* RegionState::find(
    py::handle refused,
    py::handle memo,
    py::handle args,
    py::handle kwargs,
    py::handle nodes) const {
  if (!tensors_unchanged()) {
    return nullptr;
  }
  const std::optional<std::string> called = key(args, kwargs, nodes);
  if (!called.has_value()) {
    return nullptr;
  }
  const py::bytes name(*called);
  if (PyObject* found = lookup(refused, name)) {
    return found;
  }
  return values_unchanged() ? lookup(memo, name) : nullptr;
}

std::vector<at::Tensor> RegionState::inputs(py::handle args, py::handle kwargs) const {
  std::vector<at::Tensor> result(tensors_);
  for_each_argument(args, kwargs, [&](PyObject* v) { result.push_back(THPVariable_Unpack(v)); });
  return result;
}

std::vector<at::Tensor> RegionState::run(const CompiledKernel& kernel, py::handle args, py::handle kwargs) const {
  c10::SmallVector<const at::Tensor*, 32> inputs;
  for (const at::Tensor& t : tensors_) {
    inputs.push_back(&t);
  }
  // The call's tensors, which `args` and `kwargs` keep alive.
  for_each_argument(args, kwargs, [&](PyObject* v) { inputs.push_back(&THPVariable_Unpack(v)); });
  CompiledKernel::Outputs outputs;
  {
    py::gil_scoped_release no_gil;
    ReentryGuard guard;
    kernel.run(inputs, outputs);
  }
  return std::vector<at::Tensor>(outputs.begin(), outputs.end());
}

} // namespace aoti_eager
