// aoti_eager._C: the C++ fast path. aoti_eager/_extension.py builds it and is
// its only importer; aoti_eager/_runtime.py is its only caller.

#include "compiled_kernel.h"
#include "op_override.h"

#include <c10/core/DispatchKey.h>
#include <torch/csrc/Exceptions.h>
#include <torch/extension.h>

namespace py = pybind11;
using namespace aoti_eager;

namespace {

// An installed override: the kernel's state plus the registration that keeps
// it in the dispatcher. remove() (or destruction) restores the original.
struct Installed {
  std::shared_ptr<OpOverride> override;
  std::unique_ptr<c10::RegistrationHandleRAII> registration;
};

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<CompiledKernel, std::shared_ptr<CompiledKernel>>(m, "CompiledKernel")
      .def(
          py::init<const std::string&, const std::string&, std::vector<int64_t>, std::vector<int64_t>>(),
          py::arg("library_path"),
          py::arg("device"),
          py::arg("output_counts"),
          py::arg("runtime_arguments") = std::vector<int64_t>{})
      .def(
          "run",
          [](const CompiledKernel& kernel, std::vector<at::Tensor> inputs) {
            ReentryGuard guard;
            CompiledKernel::Outputs outputs;
            kernel.run(inputs, outputs);
            return std::vector<at::Tensor>(outputs.begin(), outputs.end());
          },
          py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("output_counts", &CompiledKernel::output_counts)
      .def_property_readonly("runtime_arguments", &CompiledKernel::runtime_arguments);

  py::class_<Installed>(m, "Override")
      .def(
          py::init([](const std::string& name,
                      const std::string& overload,
                      const std::string& dispatch_key,
                      int64_t token) {
            auto handle =
                c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
            auto key = c10::parseDispatchKey(dispatch_key);
            auto override = std::make_shared<OpOverride>(handle, key, token);
            // The dispatcher warns about replacing a kernel; surface that as a
            // Python warning, which enable() filters (replacing is the point).
            torch::PyWarningHandler warnings;
            auto registration = register_override(name, overload, key, override);
            return Installed{std::move(override), std::move(registration)};
          }),
          py::arg("name"),
          py::arg("overload"),
          py::arg("dispatch_key"),
          py::arg("token"))
      .def(
          "remove",
          [](Installed& self) { self.registration.reset(); })
      .def(
          "clear",
          [](Installed& self) { self.override->clear(); })
      .def_property_readonly(
          "num_entries",
          [](const Installed& self) { return self.override->num_entries(); })
      .def(
          "counters",
          [](const Installed& self) {
            const Counters& c = self.override->counters();
            py::dict d;
            d["calls"] = c.calls.load();
            d["hits"] = c.hits.load();
            d["misses"] = c.misses.load();
            d["eager_calls"] = c.eager_calls.load();
            return d;
          });

  m.def("set_miss_handler", &set_miss_handler);
  m.def("is_wrapped_number", [](const at::Tensor& t) {
    return t.unsafeGetTensorImpl()->is_wrapped_number();
  });
}
