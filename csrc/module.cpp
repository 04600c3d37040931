// aoti_eager._C: the C++ fast path. aoti_eager/_extension.py builds it and is
// its only importer; only aoti_eager/'s runtime calls it (the overrides are
// installed by aoti_eager/_overrides.py).

#include "call_key.h"
#include "compiled_kernel.h"
#include "cpu_output_pool.h"
#include "op_override.h"
#include "region_state.h"

#include <c10/core/DispatchKey.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/extension.h>

#include <chrono>
#include <map>

namespace py = pybind11;
using namespace aoti_eager;

namespace {

// An installed override: the kernel's state plus the registration that keeps
// it in the dispatcher. remove() (or destruction) restores the original.
struct Installed {
  std::shared_ptr<OpOverride> override;
  std::unique_ptr<c10::RegistrationHandleRAII> registration;
  bool unboxed = false;
  std::string name;
  std::string overload;
  c10::DispatchKey dispatch_key;

  void install() {
    // The dispatcher warns about replacing a kernel; surface that as a
    // Python warning, which enable() filters (replacing is the point).
    torch::PyWarningHandler warnings;
    Registration registered = register_override(name, overload, dispatch_key, override);
    registration = std::move(registered.handle);
    unboxed = registered.unboxed;
  }
};

// CompiledKernel::run's inputs: `tensors`, which the caller keeps alive.
std::vector<const at::Tensor*> pointers(const std::vector<at::Tensor>& tensors) {
  std::vector<const at::Tensor*> result;
  for (const at::Tensor& t : tensors) {
    result.push_back(&t);
  }
  return result;
}

// Nanoseconds per call of `fn`, over `calls` calls.
template <typename F>
double ns_per_call(int64_t calls, F&& fn) {
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < calls; ++i) {
    fn();
  }
  const std::chrono::duration<double, std::nano> elapsed = std::chrono::steady_clock::now() - start;
  return elapsed.count() / calls;
}

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<CompiledKernel, std::shared_ptr<CompiledKernel>>(m, "CompiledKernel")
      .def(
          py::init([](const std::string& library_path,
                      const std::string& device,
                      std::vector<int64_t> output_counts,
                      const py::iterable& runtime_arguments) {
            return std::make_shared<CompiledKernel>(
                library_path, device, std::move(output_counts), runtime_numbers(runtime_arguments));
          }),
          py::arg("library_path"),
          py::arg("device"),
          py::arg("output_counts"),
          py::arg("runtime_arguments") = py::tuple())
      .def(
          "run",
          [](const CompiledKernel& kernel, std::vector<at::Tensor> inputs) {
            ReentryGuard guard;
            CompiledKernel::Outputs outputs;
            kernel.run(pointers(inputs), outputs);
            return std::vector<at::Tensor>(outputs.begin(), outputs.end());
          },
          py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("output_counts", &CompiledKernel::output_counts)
      .def_property_readonly("num_inputs", &CompiledKernel::num_inputs)
      .def_property_readonly("num_outputs", &CompiledKernel::num_outputs);

  // aoti_eager/_region_calls.py's hit path: see csrc/region_state.h.
  py::class_<RegionState, std::shared_ptr<RegionState>>(m, "RegionState")
      .def(
          py::init([](std::vector<at::Tensor> tensors,
                      std::vector<std::tuple<py::dict, py::str, py::object>> values,
                      std::vector<py::dict> sized) {
            return std::make_shared<RegionState>(std::move(tensors), std::move(values), std::move(sized));
          }),
          py::arg("tensors"),
          py::arg("values"),
          py::arg("sized"))
      .def("unchanged", &RegionState::unchanged)
      .def(
          "find",
          // Handles, not py::dict and py::tuple: the hit path's one call skips their casters' checks (the caller's
          // arguments are a tuple and dicts, as its own *args and **kwargs are).
          [](const RegionState& state, py::handle refused, py::handle memo, py::handle args, py::handle kwargs,
             py::handle nodes) -> py::object {
            PyObject* found = state.find(refused, memo, args, kwargs, nodes);
            return found == nullptr ? py::object(py::none()) : py::reinterpret_borrow<py::object>(found);
          },
          py::arg("refused"),
          py::arg("memo"),
          py::arg("args"),
          py::arg("kwargs"),
          py::arg("nodes"))
      .def_static(
          "key",
          [](const py::tuple& args, const py::dict& kwargs, const py::dict& nodes) -> py::object {
            std::optional<std::string> key = RegionState::key(args, kwargs, nodes);
            return key.has_value() ? py::object(py::bytes(*key)) : py::object(py::none());
          },
          py::arg("args"),
          py::arg("kwargs"),
          py::arg("nodes"))
      .def(
          "run",
          [](const RegionState& state, const py::object& kernel, const py::tuple& args, const py::dict& kwargs) {
            if (py::isinstance<CompiledKernel>(kernel)) {
              return py::cast(state.run(kernel.cast<const CompiledKernel&>(), args, kwargs));
            }
            // Any other kernel object: its run() on the flat inputs.
            return kernel.attr("run")(state.inputs(args, kwargs));
          },
          py::arg("kernel"),
          py::arg("args"),
          py::arg("kwargs"));

  py::class_<Installed>(m, "Override")
      .def(
          py::init([](const std::string& name,
                      const std::string& overload,
                      const std::string& dispatch_key,
                      int64_t token) {
            auto handle =
                c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
            auto key = c10::parseDispatchKey(dispatch_key);
            Installed installed{std::make_shared<OpOverride>(handle, key, token), nullptr, false, name, overload, key};
            installed.install();
            return installed;
          }),
          py::arg("name"),
          py::arg("overload"),
          py::arg("dispatch_key"),
          py::arg("token"))
      .def(
          "remove",
          [](Installed& self) { self.registration.reset(); })
      // After remove(): the override is the op's kernel again, with every
      // decision and loaded kernel it had, and its counters at zero.
      .def(
          "restore",
          [](Installed& self) {
            if (self.registration == nullptr) {
              self.override->reset_counters();
              self.install();
            }
          })
      .def(
          "clear",
          [](Installed& self) { self.override->clear(); })
      // Whether the dispatcher calls it with the op's C++ arguments (see
      // register_override), not boxed.
      .def_property_readonly(
          "unboxed",
          [](const Installed& self) { return self.unboxed; })
      .def_property_readonly(
          "num_entries",
          [](const Installed& self) { return self.override->num_entries(); })
      .def(
          "counters",
          [](const Installed& self) {
            const Counters& c = self.override->counters();
            py::dict d;
            d["calls"] = c.calls();
            d["hits"] = c.hits.load();
            d["misses"] = c.misses.load();
            d["eager_calls"] = c.eager_calls.load();
            d["boxed_calls"] = c.boxed_calls.load();
            return d;
          });

  m.def("set_miss_handler", &set_miss_handler);
  // Python's own work on this thread (a region's compile, its eager reference
  // and its check): the original kernels run, as inside a miss.
  m.def("enter_own_work", [] { ++ReentryGuard::depth(); });
  m.def("leave_own_work", [] { --ReentryGuard::depth(); });
  m.def("is_wrapped_number", [](const at::Tensor& t) {
    return t.unsafeGetTensorImpl()->is_wrapped_number();
  });
  // For tests/test_cpu_output_pool.py: whether `t`'s memory is a block of the pool.
  m.def("from_cpu_output_pool", [](const at::Tensor& t) {
    return t.has_storage() && from_cpu_output_pool(t.storage().data_ptr());
  });
  m.def("set_cpu_pool_limit", &set_cpu_pool_limit);
  m.def("cpu_pool_held_bytes", &cpu_pool_held_bytes);
  // For scripts/profile_hit_path.py: ns per call, each in its own loop, of
  // the stages of the hit path for one call of `name.overload` with `args`
  // (in schema order): keying the arguments, the compiled kernel alone on its
  // flat `inputs`, and the whole boxed call through the dispatcher (with
  // whatever kernel is registered for it now).
  m.def(
      "time_stages",
      [](const std::string& name,
         const std::string& overload,
         py::list py_args,
         const CompiledKernel& kernel,
         std::vector<at::Tensor> inputs,
         int64_t calls) {
        auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
        const auto& schema = op.schema();
        std::vector<c10::IValue> args;
        for (size_t i = 0; i < py_args.size(); ++i) {
          args.push_back(torch::jit::toIValue(py_args[i], schema.arguments()[i].type()));
        }
        py::gil_scoped_release no_gil;
        std::map<std::string, double> ns;
        CallKey key;
        ns["key"] = ns_per_call(calls, [&] { compute_call_key(args, schema.is_mutable(), key); });
        const auto input_pointers = pointers(inputs);
        ns["kernel"] = ns_per_call(calls, [&] {
          ReentryGuard guard;
          CompiledKernel::Outputs outputs;
          kernel.run(input_pointers, outputs);
        });
        ns["call"] = ns_per_call(calls, [&] {
          torch::jit::Stack stack(args.begin(), args.end());
          op.callBoxed(stack);
        });
        return ns;
      });
}
