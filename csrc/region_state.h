#pragma once

// A fused region's hit path (aoti_eager/_region_calls.py): an instance's
// state as its kernel takes it, checked unchanged on each call without
// rebuilding it; the in-process key of a call's arguments; the kernel run on
// the state's tensors then the call's.

#include "compiled_kernel.h"

#include <ATen/core/Tensor.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace aoti_eager {

class RegionState {
 public:
  // `tensors`: the instance's parameters then buffers, as its kernel takes
  // them. `values`: (mapping, name, value) of each Python value the state
  // depends on (kernels/region_values.py: the modules, parameters, buffers
  // and training flags of its tree, the values a forward may read), each
  // still the same object while the state is unchanged. `sized`: dicts whose
  // sizes stay as they are now (hooks, and the parameters, buffers and
  // submodules of each module of the tree).
  RegionState(
      std::vector<at::Tensor> tensors,
      std::vector<std::tuple<pybind11::dict, pybind11::str, pybind11::object>> values,
      std::vector<pybind11::dict> sized);

  // Whether the state is as when it was prepared: its tensors (each one's
  // data pointer, dtype, device, sizes, strides and requires_grad, which
  // .to(), `.data =` and requires_grad_() change on the same objects) and the
  // sizes of its dicts, then its values.
  bool unchanged() const;
  bool tensors_unchanged() const;
  bool values_unchanged() const;

  // The key of a call in this process: grad mode, autocast (and its dtype), the default
  // dtype, then `args` and `kwargs` (its names, in order) as pytree
  // flattens them, tuples, lists and dicts keyed with their sizes: a
  // tensor's dtype, device, sizes, strides, alignment and requires_grad; a
  // None, bool, int, float or str by value; a value that is no pytree node
  // in `nodes` (pytree's registered types) and no call of a region takes, by
  // its type. nullopt for any other value (the caller flattens the call
  // with its pytree, or takes the slow path).
  static std::optional<std::string> key(pybind11::handle args, pybind11::handle kwargs, pybind11::handle nodes);

  // What the call runs, by its key (`key()`'s, as bytes): what `refused`
  // holds under it where the state's tensors and dicts are unchanged (running
  // the original forward is right whatever else changed: a value only
  // decides whether a kernel may serve), else what `memo` holds where the
  // whole state is unchanged; nullptr where neither holds it, the state
  // changed, or the call has no key here. The hit path's one lookup.
  PyObject* find(
      pybind11::handle refused,
      pybind11::handle memo,
      pybind11::handle args,
      pybind11::handle kwargs,
      pybind11::handle nodes) const;

  // A kernel's inputs: the state's tensors then the tensors in `args` and
  // `kwargs`, in the order of the call's pytree leaves (tuples, lists and
  // dicts entered); `run` runs `kernel` on them.
  std::vector<at::Tensor> inputs(pybind11::handle args, pybind11::handle kwargs) const;
  std::vector<at::Tensor> run(const CompiledKernel& kernel, pybind11::handle args, pybind11::handle kwargs) const;

 private:
  std::vector<at::Tensor> tensors_;
  std::optional<std::string> fingerprint_; // nullopt: never unchanged (see unchanged())
  std::vector<std::tuple<pybind11::dict, pybind11::str, pybind11::object>> values_;
  std::vector<std::pair<pybind11::dict, Py_ssize_t>> sized_; // each dict and its size when prepared
};

} // namespace aoti_eager
