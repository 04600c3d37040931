#pragma once

// A kernel that AOTInductor compiled for one call signature of one op, loaded
// from its shared library.

#include "call_key.h"

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/inductor/aoti_runner/model_container_runner.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace aoti_eager {

// kernels/inductor/wrapper_split.py: _ENTRY_POINT.
using LibraryEntryPoint = AOTIRuntimeError (*)(
    AOTInductorModelContainerHandle,
    AtenTensorHandle*,
    AtenTensorHandle*,
    AOTInductorStreamHandle,
    AOTIProxyExecutorHandle);

class CompiledKernel {
 public:
  // `device` is where the kernel runs ("cpu", "cuda:1"). `output_counts` has
  // one entry per return of the op's schema: -1 for a Tensor, N for a
  // Tensor[] of N tensors, 0 for a return that aliases a mutated argument
  // (the kernel writes into that argument in place).
  // `runtime_numbers`: the numbers that the kernel takes as 0-d CPU tensors
  // (int64 for an int, float64 for a float) instead of compiled-in values,
  // in argument order, and in item order within a list.
  // Throws unless `output_counts` describes as many outputs as the library has.
  CompiledKernel(
      const std::string& library_path,
      const std::string& device,
      std::vector<int64_t> output_counts,
      std::vector<RuntimeNumber> runtime_numbers = {});

  using Outputs = c10::SmallVector<at::Tensor, 4>;

  // Runs on `inputs`, the kernel's flat tensor inputs, which the caller keeps
  // alive for the call, and appends its outputs to `outputs`.
  void run(c10::ArrayRef<const at::Tensor*> inputs, Outputs& outputs) const;

  const std::vector<int64_t>& output_counts() const {
    return output_counts_;
  }

  const std::vector<RuntimeNumber>& runtime_numbers() const {
    return runtime_numbers_;
  }

  // What the library itself says it takes and returns.
  size_t num_inputs() const {
    return num_inputs_;
  }

  size_t num_outputs() const {
    return num_outputs_;
  }

 private:
  c10::Device device_;
  std::unique_ptr<torch::inductor::AOTIModelContainerRunner> runner_;
  // The runner's container and entry point, called directly (see the constructor).
  AOTInductorModelContainerHandle container_ = nullptr;
  AOTIProxyExecutorHandle proxy_executor_ = nullptr;
  decltype(&AOTInductorModelContainerRun) run_func_ = nullptr;
  // kernels/inductor/wrapper_split.py: _ENTRY_POINT; null in a library built whole.
  LibraryEntryPoint entry_point_ = nullptr;
  size_t num_inputs_ = 0;
  size_t num_outputs_ = 0;
  bool borrows_inputs_ = false; // kernels/inductor/wrapper_split.py: _borrow_inputs
  mutable std::mutex run_mutex_;
  std::vector<int64_t> output_counts_;
  std::vector<RuntimeNumber> runtime_numbers_;
};

} // namespace aoti_eager
