#include "compiled_kernel.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

namespace aoti_eager {

CompiledKernel::CompiledKernel(
    const std::string& library_path,
    const std::string& device,
    std::vector<int64_t> output_counts,
    std::vector<int64_t> runtime_arguments)
    : device_(device),
      output_counts_(std::move(output_counts)),
      runtime_arguments_(std::move(runtime_arguments)) {
  // Runners are created through AOTInductor's registry so that CUDA support
  // comes from libtorch_cuda at run time and this extension needs no CUDA
  // toolkit to build.
  const std::string device_type = c10::DeviceTypeName(device_.type(), /*lower_case=*/true);
  auto& registry = torch::inductor::getAOTIModelRunnerRegistry();
  auto it = registry.find(device_type);
  TORCH_CHECK(
      it != registry.end(),
      "aoti_eager: this PyTorch build has no AOTInductor runner for device '",
      device_type,
      "'");
  // One model, run without the container's model pool: the pool's locks and
  // its CUDA event per run (recorded, then waited on by the next run) cost
  // more than a small kernel, and that wait is not allowed while a CUDA graph
  // is being captured. run_mutex_ serializes the runs instead.
  runner_ = it->second(
      library_path,
      /*num_models=*/1,
      device,
      /*bin_dir=*/"",
      /*run_single_threaded=*/true);
}

std::vector<at::Tensor> CompiledKernel::run(
    std::vector<at::Tensor>& inputs) const {
  std::lock_guard<std::mutex> lock(run_mutex_);
  if (device_.is_cpu()) {
    return runner_->run(inputs, /*stream_handle=*/nullptr);
  }
  // On the kernel's device and the caller's current stream there, as eager
  // would run. Through the device-generic interface, so that this extension
  // builds without CUDA headers.
  c10::DeviceGuard device_guard(device_);
  const auto* guard_impl = c10::impl::getDeviceGuardImpl(device_.type());
  return runner_->run(inputs, guard_impl->getStream(device_).native_handle());
}

} // namespace aoti_eager
