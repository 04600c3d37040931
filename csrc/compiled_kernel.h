#pragma once

// A kernel that AOTInductor compiled for one call signature of one op, loaded
// from its shared library.

#include <ATen/core/Tensor.h>
#include <torch/csrc/inductor/aoti_runner/model_container_runner.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace aoti_eager {

class CompiledKernel {
 public:
  // `device` is where the kernel runs ("cpu", "cuda:1"). `output_counts` has
  // one entry per return of the op's schema: -1 for a Tensor, N for a
  // Tensor[] of N tensors, 0 for a return that aliases a mutated argument
  // (the kernel writes into that argument in place).
  // `runtime_arguments`: indices of the op's arguments that the kernel takes
  // as runtime numbers (0-d float64 CPU tensors) instead of compiled-in values.
  CompiledKernel(
      const std::string& library_path,
      const std::string& device,
      std::vector<int64_t> output_counts,
      std::vector<int64_t> runtime_arguments = {});

  std::vector<at::Tensor> run(std::vector<at::Tensor>& inputs) const;

  const std::vector<int64_t>& output_counts() const {
    return output_counts_;
  }

  const std::vector<int64_t>& runtime_arguments() const {
    return runtime_arguments_;
  }

 private:
  c10::Device device_;
  std::unique_ptr<torch::inductor::AOTIModelContainerRunner> runner_;
  mutable std::mutex run_mutex_;
  std::vector<int64_t> output_counts_;
  std::vector<int64_t> runtime_arguments_;
};

} // namespace aoti_eager
