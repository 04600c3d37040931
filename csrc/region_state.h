#pragma once

// A fused region's hit path (aoti_eager/_regions.py): an instance's state as
// its kernel takes it, checked unchanged on each call without rebuilding it;
// the in-process key of a call's arguments; the kernel run on the state's
// tensors then the call's.

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
  // them. `modules`: its submodules (not the instance itself: the caller
  // passes it to each call, as the instance is held weakly).
  // `values`: (mapping, name, value) of each Python value a forward may
  // read (kernels/region_values.py), each still the same object while the
  // state is unchanged. `hooks`: dicts whose sizes stay as they are now.
  RegionState(
      std::vector<at::Tensor> tensors,
      std::vector<pybind11::object> modules,
      pybind11::handle root,
      std::vector<std::tuple<pybind11::dict, pybind11::str, pybind11::object>> values,
      std::vector<pybind11::dict> hooks);

  // Whether the state is as when it was prepared: each tensor's data pointer,
  // dtype, device, sizes, strides and requires_grad (.to(), `.data =` and
  // requires_grad_() change them on the same objects), the training flag
  // of `root` and of each submodule, its Python values and hook dicts' sizes.
  bool unchanged(pybind11::handle root) const;

  // The key of a call in this process: grad mode, autocast, the default
  // dtype, then each argument (kwargs with their names, in order): a
  // tensor's dtype, device, sizes, strides, alignment and requires_grad; a
  // None, bool, int, float or str by value. nullopt for any other value
  // (the caller flattens the call with its pytree, or takes the slow path).
  static std::optional<std::string> key(pybind11::handle args, pybind11::handle kwargs);

  // A kernel's inputs: the state's tensors then the tensors among `args`
  // and `kwargs`' values, in that order (the order of the call's pytree
  // leaves); `run` runs `kernel` on them.
  std::vector<at::Tensor> inputs(pybind11::handle args, pybind11::handle kwargs) const;
  std::vector<at::Tensor> run(const CompiledKernel& kernel, pybind11::handle args, pybind11::handle kwargs) const;

 private:
  std::vector<at::Tensor> tensors_;
  std::optional<std::string> fingerprint_; // nullopt: never unchanged (see unchanged())
  std::vector<pybind11::object> modules_;
  std::vector<int> training_; // the root's, then each of modules_' (1, 0; -1: not a bool)
  std::vector<std::tuple<pybind11::dict, pybind11::str, pybind11::object>> values_;
  std::vector<std::pair<pybind11::dict, Py_ssize_t>> hooks_; // each dict and its size when prepared
};

} // namespace aoti_eager
