#include "compiled_kernel.h"
#include "cpu_output_pool.h"

#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/AutogradState.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include <dlfcn.h>

#include <optional>

namespace aoti_eager {
namespace {

using torch::inductor::AOTIModelContainerRunner;

// AOTIModelContainerRunner::run converts every call through heap-allocated
// vectors (input handles, output handles, the returned tensors) and a hash
// map that removes duplicate outputs: as much time as an op-sized kernel
// itself. The runner keeps the model container and the entry point it chose
// as protected members; a pointer to member named through a derived class
// reads them without changing the runner.
struct RunnerInternals : AOTIModelContainerRunner {
  static AOTInductorModelContainerHandle container(AOTIModelContainerRunner& r) {
    return r.*(&RunnerInternals::container_handle_);
  }
  static AOTIProxyExecutorHandle proxy_executor(AOTIModelContainerRunner& r) {
    return r.*(&RunnerInternals::proxy_executor_handle_);
  }
  static decltype(&AOTInductorModelContainerRun) run_func(AOTIModelContainerRunner& r) {
    return r.*(&RunnerInternals::run_func_);
  }
  static decltype(&AOTInductorModelContainerGetNumOutputs) num_outputs_func(
      AOTIModelContainerRunner& r) {
    return r.*(&RunnerInternals::get_num_outputs_func_);
  }
};

// AOTInductor's shim allocates a CUDA tensor through at::empty_strided, a
// dispatcher round trip that was a large share of a tiny CUDA call
// (BENCHMARKS.md, "Per-call dispatch"). Eager's CUDA kernels take their
// outputs straight from the caching allocator, and so does this, as
// at::detail::empty_strided_cuda does. A CPU tensor comes from the pool of
// freed blocks (csrc/cpu_output_pool.h), as at::detail::empty_strided_cpu
// makes it otherwise. Every other case is the
// shim's, as is deterministic mode, which fills new memory.
AOTITorchError empty_strided(
    int64_t ndim,
    const int64_t* sizes,
    const int64_t* strides,
    int32_t dtype,
    int32_t device_type,
    int32_t device_index,
    AtenTensorHandle* result) {
  const auto type = static_cast<c10::DeviceType>(device_type);
  if ((type != c10::DeviceType::CUDA && type != c10::DeviceType::CPU) ||
      (at::globalContext().deterministicFillUninitializedMemory() &&
       at::globalContext().deterministicAlgorithms())) {
    return aoti_torch_empty_strided(ndim, sizes, strides, dtype, device_type, device_index, result);
  }
  try {
    const bool cuda = type == c10::DeviceType::CUDA;
    std::optional<c10::DeviceGuard> device_guard;
    if (cuda) {
      device_guard.emplace(c10::Device(type, static_cast<c10::DeviceIndex>(device_index)));
    }
    at::TensorBase tensor = at::detail::empty_strided_generic(
        c10::IntArrayRef(sizes, ndim),
        c10::IntArrayRef(strides, ndim),
        cuda ? at::detail::getCUDAHooks().getCUDADeviceAllocator() : cpu_output_allocator(),
        c10::DispatchKeySet(cuda ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU),
        static_cast<c10::ScalarType>(dtype));
    *result = reinterpret_cast<AtenTensorHandle>(new at::Tensor(std::move(tensor)));
    return AOTI_TORCH_SUCCESS;
  } catch (...) {
    // Out of memory, say: reported as AOTInductor's shim reports it.
    return aoti_torch_empty_strided(ndim, sizes, strides, dtype, device_type, device_index, result);
  }
}

// The number of inputs the library's model container takes (the runner keeps
// no entry point for it).
size_t library_num_inputs(const std::string& library_path, AOTInductorModelContainerHandle container) {
  void* library = dlopen(library_path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  TORCH_CHECK(library != nullptr, "aoti_eager: ", library_path, " is not loaded");
  auto get_num_inputs = reinterpret_cast<decltype(&AOTInductorModelContainerGetNumInputs)>(
      dlsym(library, "AOTInductorModelContainerGetNumInputs"));
  size_t num_inputs = 0;
  const AOTIRuntimeError error =
      get_num_inputs != nullptr ? get_num_inputs(container, &num_inputs) : AOTI_RUNTIME_FAILURE;
  dlclose(library);
  TORCH_CHECK(error == AOTI_RUNTIME_SUCCESS, "aoti_eager: ", library_path, " does not report its number of inputs");
  return num_inputs;
}

// A library whose wrapper was built in parts (kernels/inductor/wrapper_split.py)
// allocates through a hook, left empty (the shim) until set here, and has its
// own entry point. Returns that entry point (or null), and sets `borrows` to
// whether the library borrows its inputs instead of taking them over.
LibraryEntryPoint read_library_hooks(const std::string& library_path, bool& borrows) {
  void* library = dlopen(library_path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (library == nullptr) {
    return nullptr;
  }
  if (void* hook = dlsym(library, "aoti_eager_empty_strided_hook")) {
    *static_cast<decltype(&empty_strided)*>(hook) = &empty_strided;
  }
  borrows = dlsym(library, "aoti_eager_borrows_inputs") != nullptr;
  auto entry = reinterpret_cast<LibraryEntryPoint>(dlsym(library, "aoti_eager_run"));
  // The runner keeps the library loaded for as long as the kernel lives.
  dlclose(library);
  return entry;
}

// Grad mode off for the call, as AOTInductor's entry point sets it (a kernel
// that calls back into the dispatcher must not record autograd), with one
// thread-local lookup instead of its three shim calls.
class NoGradForCall {
 public:
  NoGradForCall() : state_(c10::AutogradState::get_tls_state()), previous_(state_.get_grad_mode()) {
    state_.set_grad_mode(false);
  }
  ~NoGradForCall() {
    state_.set_grad_mode(previous_);
  }
  NoGradForCall(const NoGradForCall&) = delete;
  NoGradForCall& operator=(const NoGradForCall&) = delete;

 private:
  c10::AutogradState& state_;
  const bool previous_;
};

} // namespace

CompiledKernel::CompiledKernel(
    const std::string& library_path,
    const std::string& device,
    std::vector<int64_t> output_counts,
    std::vector<RuntimeNumber> runtime_numbers)
    : device_(device),
      output_counts_(std::move(output_counts)),
      runtime_numbers_(std::move(runtime_numbers)) {
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
  // is being captured. run_mutex_ serializes the runs instead. The runner
  // then holds AOTInductorModelContainerRunSingleThreaded as its entry point.
  runner_ = it->second(
      library_path,
      /*num_models=*/1,
      device,
      /*bin_dir=*/"",
      /*run_single_threaded=*/true);
  container_ = RunnerInternals::container(*runner_);
  proxy_executor_ = RunnerInternals::proxy_executor(*runner_);
  run_func_ = RunnerInternals::run_func(*runner_);
  TORCH_CHECK(container_ != nullptr && run_func_ != nullptr, "aoti_eager: runner without a model container");
  AOTI_RUNTIME_ERROR_CODE_CHECK(
      RunnerInternals::num_outputs_func(*runner_)(container_, &num_outputs_));
  num_inputs_ = library_num_inputs(library_path, container_);
  // Once per load, so that no call reads past the outputs the library hands back.
  size_t described = 0;
  for (int64_t count : output_counts_) {
    TORCH_CHECK(count >= -1, "aoti_eager: output count ", count, " describes no output");
    described += count < 0 ? 1 : static_cast<size_t>(count);
  }
  TORCH_CHECK(
      described == num_outputs_,
      "aoti_eager: the kernel's metadata describes ",
      described,
      " outputs, its library returns ",
      num_outputs_);
  entry_point_ = read_library_hooks(library_path, borrows_inputs_);
}

void CompiledKernel::run(c10::ArrayRef<const at::Tensor*> inputs, Outputs& outputs) const {
  // AOTInductor's library takes ownership of one new at::Tensor per input
  // (and a vector of owners of them); one built to borrow them reads the
  // caller's. Either hands back a new at::Tensor per output.
  c10::SmallVector<AtenTensorHandle, 8> input_handles;
  input_handles.reserve(inputs.size());
  for (const at::Tensor* t : inputs) {
    input_handles.push_back(reinterpret_cast<AtenTensorHandle>(
        borrows_inputs_ ? const_cast<at::Tensor*>(t) : new at::Tensor(*t)));
  }
  c10::SmallVector<AtenTensorHandle, 4> output_handles(num_outputs_, nullptr);
  void* stream = nullptr;
  std::optional<c10::DeviceGuard> device_guard;
  if (!device_.is_cpu()) {
    // On the kernel's device and the caller's current stream there, as eager
    // would run. Through the device-generic interface, so that this extension
    // builds without CUDA headers.
    device_guard.emplace(device_);
    stream = c10::impl::getDeviceGuardImpl(device_.type())->getStream(device_).native_handle();
  }
  {
    std::lock_guard<std::mutex> lock(run_mutex_);
    if (entry_point_ != nullptr) {
      const NoGradForCall no_grad;
      AOTI_RUNTIME_ERROR_CODE_CHECK(entry_point_(
          container_,
          input_handles.data(),
          output_handles.data(),
          reinterpret_cast<AOTInductorStreamHandle>(stream),
          proxy_executor_));
    } else {
      AOTI_RUNTIME_ERROR_CODE_CHECK(run_func_(
          container_,
          input_handles.data(),
          input_handles.size(),
          output_handles.data(),
          output_handles.size(),
          reinterpret_cast<AOTInductorStreamHandle>(stream),
          proxy_executor_));
    }
  }
  for (size_t i = 0; i < output_handles.size(); ++i) {
    auto* handle = reinterpret_cast<at::Tensor*>(output_handles[i]);
    // A graph that returns one buffer twice hands back one handle twice.
    size_t first = 0;
    while (output_handles[first] != output_handles[i]) {
      ++first;
    }
    if (first < i) {
      at::Tensor same = outputs[outputs.size() - i + first];
      outputs.push_back(std::move(same));
    } else {
      outputs.push_back(std::move(*handle));
      delete handle;
    }
  }
}

} // namespace aoti_eager
