#include "op_override.h"

#include <ATen/core/stack.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/tensor_memoryformats.h>
#include <torch/library.h>

#include <algorithm>
#include <mutex>
#include <tuple>

namespace py = pybind11;

namespace aoti_eager {
namespace {

thread_local int reentry_depth = 0;

// Leaked on purpose: it must outlive every override, and destroying a Python
// object at process exit without the GIL is not safe.
py::object* miss_handler = nullptr;

// A boxed kernel that hands the whole call to OpOverride::call.
class WholeBoxedOverride final : public c10::OperatorKernel {
 public:
  explicit WholeBoxedOverride(std::shared_ptr<OpOverride> override)
      : override_(std::move(override)) {}

  void operator()(
      const c10::OperatorHandle& op,
      c10::DispatchKeySet keys,
      torch::jit::Stack* stack) {
    override_->call(op, keys, stack);
  }

 private:
  std::shared_ptr<OpOverride> override_;
};

// c10::SafeKernelFunction (the original kernel, as the dispatcher hands it
// out) calls its kernel boxed only. Its members, for calling the kernel
// unboxed: explicit instantiation is the one place where C++ does not check
// access to the names it is given ([temp.spec.general]).
template <class Tag, auto Member>
struct PrivateMember {
  friend constexpr auto member_of(Tag) {
    return Member;
  }
};
struct KernelOf {
  friend constexpr auto member_of(KernelOf);
};
struct TokenOf {
  friend constexpr auto member_of(TokenOf);
};
template struct PrivateMember<KernelOf, &c10::SafeKernelFunction::kernel_>;
template struct PrivateMember<TokenOf, &c10::SafeKernelFunction::token_>;

// Calls `original` unboxed where its kernel has an unboxed function, with
// the check of SafeKernelFunction::callBoxed (the kernel still registered).
template <class Return, class... Args>
Return call_unboxed(
    const c10::SafeKernelFunction& original,
    const c10::OperatorHandle& op,
    c10::DispatchKeySet keys,
    Args... args) {
  const auto& token = original.*member_of(TokenOf{});
  TORCH_CHECK(token && token->isValid(), "aoti_eager: the original kernel of ", op.operator_name(), " is gone");
  return (original.*member_of(KernelOf{})).template call<Return, Args...>(op, keys, std::forward<Args>(args)...);
}

// Like torch::jit::toPyObject, but with the enums that the dispatcher stack
// carries as plain ints (dtype, layout, memory format) turned back into their
// Python objects, so that Python can call the op with them.
py::object to_python(const c10::IValue& value, const c10::TypePtr& declared) {
  if (value.isInt()) {
    c10::TypePtr type = declared;
    if (auto optional = type->cast<c10::OptionalType>()) {
      type = optional->getElementType();
    }
    switch (type->kind()) {
      case c10::TypeKind::ScalarTypeType:
        return py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(
            torch::getTHPDtype(static_cast<at::ScalarType>(value.toInt()))));
      case c10::TypeKind::LayoutType:
        return py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(
            torch::getTHPLayout(static_cast<at::Layout>(value.toInt()))));
      case c10::TypeKind::MemoryFormatType:
        return py::reinterpret_borrow<py::object>(torch::utils::getTHPMemoryFormat(
            static_cast<at::MemoryFormat>(value.toInt())));
      default:
        break;
    }
  }
  return torch::jit::toPyObject(value);
}

// A number the kernel reads at run time, as kernels/compile.py's
// runtime_number_input makes it: a Python float or int, or the wrapped number
// a Tensor argument received for a float. An int goes into a 0-d int64 tensor,
// anything else into a float64 one: the call key tells ints from doubles, so
// a kernel only ever sees the kind it was traced with. The tensor is kept per
// thread and position among the call's runtime numbers, reused while no one
// else holds it, instead of a new tensor per call.
const at::Tensor& runtime_number(const c10::IValue& arg, at::Tensor& number) {
  if (arg.isTensor()) {
    const at::Tensor& t = arg.toTensor();
    number = t.scalar_type() == at::kDouble ? t : t.to(at::kDouble);
    return number;
  }
  const bool is_int = arg.isInt();
  const at::ScalarType dtype = is_int ? at::kLong : at::kDouble;
  if (!number.defined() || number.use_count() != 1 || number.scalar_type() != dtype) {
    number = is_int ? at::scalar_tensor(arg.toInt(), at::TensorOptions().dtype(dtype))
                    : at::scalar_tensor(arg.toDouble(), at::TensorOptions().dtype(dtype));
  } else if (is_int) {
    *number.mutable_data_ptr<int64_t>() = arg.toInt();
  } else {
    *number.mutable_data_ptr<double>() = arg.toDouble();
  }
  return number;
}

// The thread's tensors for a call's `count` runtime numbers (see
// runtime_number): sized before the call takes a reference to any, as
// growing the vector would move them (a list of scalars gives one per item).
c10::SmallVector<at::Tensor, 4>& runtime_number_slots(size_t count) {
  thread_local c10::SmallVector<at::Tensor, 4> numbers;
  if (numbers.size() < count) {
    numbers.resize(count);
  }
  return numbers;
}

// The caller's own tensors: no reference count changes (two atomic updates
// per input) for a kernel that borrows them.
using KernelInputs = c10::SmallVector<const at::Tensor*, 8>;

void add_kernel_input(const at::Tensor& t, KernelInputs& inputs) {
  // Wrapped numbers are compiled into the kernel (they are in its key).
  if (t.defined() && !t.unsafeGetTensorImpl()->is_wrapped_number()) {
    inputs.push_back(&t);
  }
}

} // namespace

ReentryGuard::ReentryGuard() : ReentryGuard(depth()) {}
int& ReentryGuard::depth() {
  return reentry_depth;
}

RuntimeNumbers runtime_numbers(const py::iterable& positions) {
  RuntimeNumbers numbers;
  for (py::handle position : positions) {
    if (py::isinstance<py::tuple>(position)) {
      auto [argument, item] = position.cast<std::pair<int64_t, int64_t>>();
      numbers.push_back({argument, item});
    } else {
      numbers.push_back({position.cast<int64_t>()});
    }
  }
  return numbers;
}

void set_miss_handler(py::object handler) {
  delete miss_handler;
  miss_handler = new py::object(std::move(handler));
}

OpOverride::OpOverride(
    const c10::OperatorHandle& op,
    c10::DispatchKey dispatch_key,
    int64_t token)
    : op_(op),
      original_(op.getComputedKernelForDispatchKey(dispatch_key)),
      schema_(&op.schema()),
      token_(token),
      num_arguments_(op.schema().arguments().size()),
      mutates_(op.schema().is_mutable()) {
  const auto& schema = op.schema();
  for (const auto& ret : schema.returns()) {
    int64_t alias = -1;
    if (ret.alias_info() && ret.alias_info()->isWrite()) {
      for (size_t i = 0; i < schema.arguments().size(); ++i) {
        const auto& arg_alias = schema.arguments()[i].alias_info();
        if (arg_alias && arg_alias->beforeSets() == ret.alias_info()->beforeSets()) {
          alias = static_cast<int64_t>(i);
          break;
        }
      }
    }
    return_aliases_.push_back(alias);
  }
}

void OpOverride::call(
    const c10::OperatorHandle& op,
    c10::DispatchKeySet keys,
    torch::jit::Stack* stack) {
  if (ReentryGuard::active()) {
    // aoti_eager's own work (compiling, validating, a kernel calling back into
    // the dispatcher) is not a user call: no counting, no lookup.
    original_.callBoxed(op, keys, stack);
    return;
  }
  CallKey key;
  auto args = torch::jit::last(*stack, num_arguments_);
  auto add_arguments = [&](CallKeyBuilder& builder) {
    return std::all_of(args.begin(), args.end(), [&](const c10::IValue& arg) { return builder.add(arg); });
  };
  if (!compute_key(add_arguments, key)) {
    counters_.other_calls.fetch_add(1, std::memory_order_relaxed);
    if (!reported_unkeyable_.exchange(true)) {
      // Once per override, so that Python can log and count the reason.
      on_miss(key, stack, /*remember=*/false);
    }
    run_original(op, keys, stack);
    return;
  }

  std::optional<Decision> decision = find(key, add_arguments);
  const bool hit = decision && decision->kernel;
  (hit ? counters_.hits : counters_.other_calls).fetch_add(1, std::memory_order_relaxed);
  if (!decision) {
    counters_.misses.fetch_add(1, std::memory_order_relaxed);
    if (auto entry = on_miss(key, stack)) {
      decision = Decision{entry->kernel.get(), std::move(entry->kernel)};
    }
  }
  if (decision && decision->kernel) {
    const CompiledKernel& kernel = *decision->kernel;
    if (kernel.runtime_numbers().empty()) {
      run_kernel(kernel, stack);
      return;
    }
    try {
      run_kernel(kernel, stack);
    } catch (const std::exception&) {
      // A kernel with runtime numbers checks what export assumed of them
      // before it computes (topk's k at most the dim's size): a value it
      // refuses runs the original kernel, which gives eager's result or error.
      // The stack still holds the arguments: run_kernel drops them last.
      run_original(op, keys, stack);
    }
  } else {
    run_original(op, keys, stack);
  }
}

template <class AddArguments>
bool OpOverride::compute_key(const AddArguments& add_arguments, CallKey& key) const {
  CallKeyBuilder builder(key);
  return add_arguments(builder) && builder.finish(mutates_);
}

std::optional<OpOverride::Entry> OpOverride::lookup(const CallKey& key) const {
  std::shared_lock<std::shared_mutex> lock(mutex_);
  auto it = entries_.find(key);
  if (it == entries_.end()) {
    return std::nullopt;
  }
  const auto retry_at = it->second.retry_at;
  if (retry_at != std::chrono::steady_clock::time_point{} && std::chrono::steady_clock::now() >= retry_at) {
    return std::nullopt;
  }
  return it->second;
}

size_t OpOverride::hot_slot(const CallKey& key) {
  // The words that tell one op's keys apart most often: the first size of
  // its first tensor (or its first number), and the last stride or number.
  const auto& w = key.words;
  const uint64_t mix = w.empty() ? 0 : static_cast<uint64_t>(w[std::min<size_t>(1, w.size() - 1)]) * 31 + w.back();
  return (mix ^ mix >> 7) % kHotSlots;
}

template <class AddArguments>
std::optional<OpOverride::Decision> OpOverride::find(
    const CallKey& key,
    const AddArguments& add_arguments) const {
  auto& slot = hot_[hot_slot(key)];
  if (const HotEntry* hot = slot.load(std::memory_order_acquire); hot != nullptr && hot->key == key) {
    return Decision{hot->kernel};
  }
  if (std::optional<Entry> entry = lookup(key)) {
    if (entry->hot != nullptr) {
      // The slot's other key was looked up last: this one is now.
      slot.store(entry->hot, std::memory_order_release);
    }
    return Decision{entry->kernel.get(), std::move(entry->kernel)};
  }
  if (!has_families_.load(std::memory_order_acquire)) {
    return std::nullopt;
  }
  std::shared_lock<std::shared_mutex> lock(mutex_);
  CallKey family_key;
  KeyedTensors tensors;
  for (const Family& family : families_) {
    tensors.clear();
    CallKeyBuilder builder(family_key, &family.dims, &tensors, &family.runtime);
    if (!add_arguments(builder) || !builder.finish(mutates_)) {
      continue;
    }
    auto it = family.kernels.find(family_key);
    if (it == family.kernels.end()) {
      continue;
    }
    for (const DynamicEntry& dynamic : it->second) {
      uint64_t size_range = 0;
      if (!dynamic.guards.admit(tensors, &size_range)) {
        continue;
      }
      if (!dynamic.per_range) {
        return Decision{dynamic.kernel.get(), dynamic.kernel};
      }
      for (const auto& [range, use_kernel] : dynamic.ranges) {
        if (range == size_range) {
          return use_kernel ? Decision{dynamic.kernel.get(), dynamic.kernel} : Decision{};
        }
      }
      return std::nullopt; // a range not judged yet: the miss path times the kernel there
    }
  }
  return std::nullopt;
}

void OpOverride::make_hot(const CallKey& key, Entry& entry) {
  auto& slot = hot_[hot_slot(key)];
  if (entry.retry_at != std::chrono::steady_clock::time_point{} || hot_entries_.size() >= kMaxHotEntries) {
    // The slot may hold this key's earlier decision (entries_ was cleared
    // since): not hot, it cannot be served any longer.
    slot.store(nullptr, std::memory_order_release);
    return;
  }
  if (entry.kernel != nullptr &&
      std::find(hot_kernels_.begin(), hot_kernels_.end(), entry.kernel) == hot_kernels_.end()) {
    hot_kernels_.push_back(entry.kernel);
  }
  entry.hot = hot_entries_.emplace_back(new HotEntry{key, entry.kernel.get()}).get();
  slot.store(entry.hot, std::memory_order_release);
}

void OpOverride::add_family(
    c10::ArrayRef<c10::IValue> args,
    std::shared_ptr<const CompiledKernel> kernel,
    const py::handle& dynamic,
    RuntimeNumbers runtime,
    const py::handle& judged) {
  DynamicDims dims;
  ShapeGuards guards;
  // Fixed sizes: the exact key's, whatever the number of elements.
  guards.limit_numel = !dynamic.is_none();
  if (!dynamic.is_none()) {
    read_guards(dynamic, dims, guards);
  }
  CallKey key;
  KeyedTensors tensors;
  uint64_t size_range = 0;
  if (!compute_call_key(args, mutates_, key, &dims, &tensors, &runtime) || !guards.admit(tensors, &size_range)) {
    return; // not this call's family after all: it keeps its exact entry only
  }
  std::unique_lock<std::shared_mutex> lock(mutex_);
  auto& entries = family_of(std::move(dims), std::move(runtime)).kernels[key];
  if (!judged.is_none()) {
    add_range_verdict(entries, judged.cast<std::shared_ptr<const CompiledKernel>>(), std::move(guards), size_range, kernel != nullptr);
    return;
  }
  // Newest first: a kernel compiled after another of its key was not admitted there.
  auto same = std::remove_if(entries.begin(), entries.end(), [&](const DynamicEntry& e) {
    return e.kernel == kernel;
  });
  entries.erase(same, entries.end());
  entries.insert(entries.begin(), DynamicEntry{std::move(kernel), std::move(guards)});
  has_families_.store(true, std::memory_order_release);
}

OpOverride::Family& OpOverride::family_of(DynamicDims dims, RuntimeNumbers runtime) {
  auto family = std::find_if(families_.begin(), families_.end(), [&](const Family& f) {
    return f.dims == dims && f.runtime == runtime;
  });
  if (family != families_.end()) {
    return *family;
  }
  auto dynamic_dims = [](const DynamicDims& d) {
    size_t n = 0;
    for (uint64_t bits : d) {
      n += __builtin_popcountll(bits);
    }
    return n;
  };
  const size_t n = dynamic_dims(dims);
  return *families_.insert(
      std::upper_bound(
          families_.begin(), families_.end(), n,
          [&](size_t count, const Family& f) { return count < dynamic_dims(f.dims); }),
      Family{std::move(dims), std::move(runtime), {}});
}

void OpOverride::add_range_verdict(
    c10::SmallVector<DynamicEntry, 1>& entries,
    std::shared_ptr<const CompiledKernel> judged,
    ShapeGuards guards,
    uint64_t size_range,
    bool use_kernel) {
  auto it = std::find_if(entries.begin(), entries.end(), [&](const DynamicEntry& e) {
    return e.kernel == judged;
  });
  if (it == entries.end()) {
    it = entries.insert(entries.begin(), DynamicEntry{std::move(judged), std::move(guards)});
  }
  it->per_range = true;
  it->ranges.emplace_back(size_range, use_kernel);
  has_families_.store(true, std::memory_order_release);
}

void OpOverride::read_guards(const py::handle& dynamic, DynamicDims& dims, ShapeGuards& guards) {
  for (auto bits : dynamic.attr("dim_bits")) {
    dims.push_back(bits.cast<uint64_t>());
  }
  for (auto range : dynamic.attr("ranges")) {
    auto pair = range.cast<std::pair<int64_t, int64_t>>();
    guards.ranges.push_back(pair);
  }
  for (auto dim : dynamic.attr("guards")) {
    auto [tensor, d, symbol, size] = dim.cast<std::tuple<int64_t, int64_t, int64_t, int64_t>>();
    TORCH_CHECK(
        symbol < static_cast<int64_t>(guards.ranges.size()),
        "aoti_eager: a dynamic kernel's guard names symbol ", symbol, " of ", guards.ranges.size());
    guards.dims.push_back({tensor, d, symbol, size});
  }
  for (auto rule : dynamic.attr("strides")) {
    auto [tensor, d, scale, factors] = rule.cast<std::tuple<int64_t, int64_t, int64_t, py::tuple>>();
    ShapeGuards::Stride stride{tensor, d, scale, {}};
    for (auto factor : factors) {
      stride.factors.push_back(factor.cast<std::pair<int64_t, int64_t>>());
    }
    guards.strides.push_back(std::move(stride));
  }
  for (auto item : dynamic.attr("orders")) {
    auto [tensor, dims_in_order] = item.cast<std::pair<int64_t, std::vector<int64_t>>>();
    guards.orders.push_back({tensor, {dims_in_order.begin(), dims_in_order.end()}});
  }
}

void OpOverride::run_original(
    const c10::OperatorHandle& op,
    c10::DispatchKeySet keys,
    torch::jit::Stack* stack) {
  counters_.eager_calls.fetch_add(1, std::memory_order_relaxed);
  // The original kernel may call another overridden overload (abs's CPU
  // kernel calls abs.out): part of this call, not a new one to key and compile.
  ReentryGuard guard;
  original_.callBoxed(op, keys, stack);
}

void OpOverride::run_kernel(
    const CompiledKernel& kernel,
    torch::jit::Stack* stack) {
  // What this call dispatches on its own (a runtime number's tensor, a kernel
  // whose graph kept an op as an extern call) must reach the original
  // kernels: an override of aten::scalar_tensor would otherwise call itself
  // for its own runtime number, without end.
  ReentryGuard guard;
  auto args = torch::jit::last(*stack, num_arguments_);
  KernelInputs inputs;
  auto add_input = [&](const at::Tensor& t) { add_kernel_input(t, inputs); };
  // The kernel's runtime numbers are in argument order, and item order in a
  // list: one pass over the arguments meets them in turn.
  auto runtime = kernel.runtime_numbers().begin();
  const auto runtime_end = kernel.runtime_numbers().end();
  size_t numbers = 0;
  auto* slots = runtime == runtime_end ? nullptr : &runtime_number_slots(kernel.runtime_numbers().size());
  auto add_runtime_number = [&](const c10::IValue& value, size_t argument, int64_t item) {
    if (runtime == runtime_end || runtime->argument != static_cast<int64_t>(argument) || runtime->item != item) {
      return false;
    }
    ++runtime;
    inputs.push_back(&runtime_number(value, (*slots)[numbers++]));
    return true;
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& arg = args[i];
    if (add_runtime_number(arg, i, -1)) {
      continue;
    }
    if (arg.isTensor()) {
      add_input(arg.toTensor());
    } else if (arg.isList()) {
      // Every list, tensor and int lists included (the call key gave it the
      // kernel's length), read in place: the stack keeps its items alive.
      const auto items = arg.toListRef();
      for (size_t j = 0; j < items.size(); ++j) {
        if (!add_runtime_number(items[j], i, static_cast<int64_t>(j)) && items[j].isTensor()) {
          add_input(items[j].toTensor());
        }
      }
    }
  }

  CompiledKernel::Outputs outputs;
  kernel.run(inputs, outputs);

  const auto& counts = kernel.output_counts();
  c10::SmallVector<c10::IValue, 4> results;
  size_t next = 0;
  for (size_t r = 0; r < return_aliases_.size(); ++r) {
    if (return_aliases_[r] >= 0) {
      results.push_back(args[return_aliases_[r]]);
    } else if (counts[r] < 0) {
      results.emplace_back(std::move(outputs[next++]));
    } else {
      c10::List<at::Tensor> list;
      list.reserve(counts[r]);
      for (int64_t i = 0; i < counts[r]; ++i) {
        list.push_back(std::move(outputs[next++]));
      }
      results.emplace_back(std::move(list));
    }
  }
  torch::jit::drop(*stack, num_arguments_);
  for (auto& result : results) {
    torch::jit::push(*stack, std::move(result));
  }
}

std::optional<OpOverride::Entry> OpOverride::on_miss(
    const CallKey& key,
    torch::jit::Stack* stack,
    bool remember) {
  py::gil_scoped_acquire gil;
  // Another thread may have decided this signature while we waited.
  if (auto entry = lookup(key)) {
    return entry;
  }
  if (miss_handler == nullptr) {
    return std::nullopt;
  }
  Entry entry;
  try {
    ReentryGuard guard;
    // The miss path runs torch.export and Inductor: they need the dispatcher
    // as a fresh thread sees it, not the keys that autograd excluded on its
    // way down to this kernel.
    c10::impl::ForceDispatchKeyGuard fresh_keys(
        c10::default_included_set, c10::default_excluded_set);
    py::list py_args;
    auto args = torch::jit::last(*stack, num_arguments_);
    for (size_t i = 0; i < args.size(); ++i) {
      py_args.append(to_python(args[i], schema_->arguments()[i].type()));
    }
    // The decision (see set_miss_handler): keep it for the key, or run this
    // call eagerly and ask again on the next; a kernel, or the original.
    py::object decision = (*miss_handler)(token_, py_args, remember);
    if (!remember) {
      return std::nullopt;
    }
    if (!decision.attr("remember").cast<bool>()) {
      const double retry_after = decision.attr("retry_after").cast<double>();
      if (retry_after <= 0) {
        return std::nullopt;
      }
      entry.retry_at = std::chrono::steady_clock::now() +
          std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(retry_after));
    }
    py::object kernel = decision.attr("kernel");
    py::object dynamic = decision.attr("dynamic");
    py::object judged = decision.attr("judged");
    RuntimeNumbers runtime;
    if (!kernel.is_none()) {
      entry.kernel = kernel.cast<std::shared_ptr<const CompiledKernel>>();
      TORCH_CHECK(
          entry.kernel->output_counts().size() == return_aliases_.size(),
          "aoti_eager: compiled kernel describes ",
          entry.kernel->output_counts().size(),
          " returns, the op has ",
          return_aliases_.size());
      runtime = entry.kernel->runtime_numbers();
    } else if (entry.retry_at == std::chrono::steady_clock::time_point{}) {
      runtime = runtime_numbers(decision.attr("numbers"));
    }
    if (!judged.is_none()) {
      // A verdict for one range of sizes: it joins the judged kernel's family.
      runtime = judged.cast<std::shared_ptr<const CompiledKernel>>()->runtime_numbers();
    }
    if (entry.retry_at == std::chrono::steady_clock::time_point{} && (!dynamic.is_none() || !runtime.empty())) {
      add_family(torch::jit::last(*stack, num_arguments_), entry.kernel, dynamic, std::move(runtime), judged);
    }
  } catch (const std::exception& e) {
    // The miss handler logs its own failures; anything that still escapes it
    // must not take the user's call down.
    PyErr_Clear();
    return std::nullopt;
  }
  std::unique_lock<std::shared_mutex> lock(mutex_);
  if (entries_.size() >= kMaxEntries) {
    // Keys carry the values of runtime numbers (one kernel serves them all),
    // so a changing learning rate adds an entry per value. Starting over
    // bounds the table; Python still holds every decision, so the next misses
    // are answered without compiling.
    entries_.clear();
  }
  make_hot(key, entry);
  // Over a retry that ran out, or one that another thread decided meanwhile.
  return entries_.insert_or_assign(key, std::move(entry)).first->second;
}

void OpOverride::clear() {
  std::unique_lock<std::shared_mutex> lock(mutex_);
  entries_.clear();
  families_.clear();
  for (auto& slot : hot_) {
    slot.store(nullptr, std::memory_order_release);
  }
  has_families_.store(false, std::memory_order_release);
}

void OpOverride::reset_counters() {
  for (auto* counter :
       {&counters_.hits, &counters_.other_calls, &counters_.misses, &counters_.eager_calls, &counters_.boxed_calls}) {
    counter->store(0);
  }
}

size_t OpOverride::num_entries() const {
  std::shared_lock<std::shared_mutex> lock(mutex_);
  return entries_.size();
}

// The override for ops of one C++ signature, which the dispatcher calls with
// the arguments as it holds them. A boxed kernel costs every call a
// std::vector<IValue> of the arguments, a reference count per tensor in and
// out of it, and the result boxed and unboxed again. Only calls of a loaded
// kernel or of a signature decided eager stay unboxed; a miss, an argument
// that cannot be keyed and a call from inside aoti_eager take the boxed path,
// where they are handled as before.
template <class FuncType>
class UnboxedOverride;

template <class Return, class... Args>
class UnboxedOverride<Return(Args...)> final : public c10::OperatorKernel {
 public:
  explicit UnboxedOverride(std::shared_ptr<OpOverride> override)
      : override_(std::move(override)),
        boxed_(c10::BoxedKernel::makeFromFunctor(std::make_unique<WholeBoxedOverride>(override_))) {}

  Return operator()(c10::DispatchKeySet keys, Args... args) {
    OpOverride& o = *override_;
    auto add_arguments = [&](CallKeyBuilder& builder) { return (builder.add(args) && ...); };
    CallKey key;
    int& depth = ReentryGuard::depth();
    const bool keyed = depth == 0 && o.compute_key(add_arguments, key);
    std::optional<OpOverride::Decision> decision = keyed ? o.find(key, add_arguments) : std::nullopt;
    if (!decision) {
      if (depth == 0) {
        o.counters_.boxed_calls.fetch_add(1, std::memory_order_relaxed);
      }
      return boxed(keys, args...);
    }
    if (!decision->kernel) {
      o.counters_.other_calls.fetch_add(1, std::memory_order_relaxed);
      return original(keys, depth, args...);
    }
    const CompiledKernel& kernel = *decision->kernel;
    if (!whole_arguments(kernel.runtime_numbers())) {
      o.counters_.boxed_calls.fetch_add(1, std::memory_order_relaxed);
      return boxed(keys, args...);
    }
    o.counters_.hits.fetch_add(1, std::memory_order_relaxed);
    if (kernel.runtime_numbers().empty()) {
      return run(kernel, depth, args...);
    }
    try {
      return run(kernel, depth, args...);
    } catch (const std::exception&) {
      // A runtime number the kernel refuses (see OpOverride::call).
      return original(keys, depth, args...);
    }
  }

 private:
  Return boxed(c10::DispatchKeySet keys, Args... args) {
    return c10::impl::BoxedKernelWrapper<Return(Args...)>::call(
        boxed_, override_->op_, keys, std::forward<Args>(args)...);
  }

  // OpOverride::run_original, without boxing the arguments: the original
  // kernel's unboxed function where it has one.
  Return original(c10::DispatchKeySet keys, int& depth, Args... args) {
    OpOverride& o = *override_;
    o.counters_.eager_calls.fetch_add(1, std::memory_order_relaxed);
    ReentryGuard guard(depth);
    return call_unboxed<Return, Args...>(o.original_, o.op_, keys, std::forward<Args>(args)...);
  }

  // Whether each of a kernel's runtime numbers is a whole argument, as run()
  // reads them; one that is an item of a list takes the boxed path.
  static bool whole_arguments(const RuntimeNumbers& runtime) {
    return std::all_of(runtime.begin(), runtime.end(), [](const RuntimeNumber& r) { return r.item < 0; });
  }

  // The C++ types whose values a kernel may take at run time (CallKeyBuilder
  // leaves them out of the key): a wrapped number's tensor, a Scalar, an int, a double.
  template <class T>
  static constexpr bool may_be_runtime_number = std::is_same_v<T, at::Tensor> ||
      std::is_same_v<T, std::optional<at::Tensor>> || std::is_same_v<T, c10::Scalar> ||
      std::is_same_v<T, int64_t> || std::is_same_v<T, double>;

  // OpOverride::run_kernel, from the C++ arguments.
  Return run(const CompiledKernel& kernel, int& depth, Args... args) {
    ReentryGuard guard(depth);
    KernelInputs inputs;
    auto runtime = kernel.runtime_numbers().begin();
    const auto runtime_end = kernel.runtime_numbers().end();
    int64_t position = 0;
    size_t numbers = 0;
    auto* slots = runtime == runtime_end ? nullptr : &runtime_number_slots(kernel.runtime_numbers().size());
    auto add_input = [&](const auto& arg) {
      using T = std::decay_t<decltype(arg)>;
      const bool is_runtime = runtime != runtime_end && runtime->argument == position++;
      if constexpr (may_be_runtime_number<T>) {
        if (is_runtime) {
          ++runtime;
          inputs.push_back(&runtime_number(c10::IValue(arg), (*slots)[numbers++]));
          return;
        }
      }
      if constexpr (std::is_same_v<T, at::Tensor>) {
        add_kernel_input(arg, inputs);
      } else if constexpr (std::is_same_v<T, std::optional<at::Tensor>>) {
        if (arg.has_value()) {
          add_kernel_input(*arg, inputs);
        }
      }
    };
    (add_input(args), ...);
    CompiledKernel::Outputs outputs;
    kernel.run(inputs, outputs);
    return results(outputs, args...);
  }

  // The call's return: the kernel's outputs in order, or for in-place and
  // out= ops the argument they wrote into.
  Return results(CompiledKernel::Outputs& outputs, Args... args) {
    if constexpr (std::is_same_v<Return, at::Tensor>) {
      return std::move(outputs[0]);
    } else if constexpr (std::is_same_v<Return, std::tuple<at::Tensor, at::Tensor, at::Tensor>>) {
      return Return(std::move(outputs[0]), std::move(outputs[1]), std::move(outputs[2]));
    } else {
      static_assert(std::is_same_v<Return, at::Tensor&>);
      const int64_t alias = override_->return_aliases_[0];
      at::Tensor* written = nullptr;
      int64_t i = 0;
      auto find_written = [&](auto& arg) {
        if constexpr (std::is_same_v<std::remove_reference_t<decltype(arg)>, at::Tensor>) {
          if (i == alias) {
            written = &arg;
          }
        }
        ++i;
      };
      (find_written(args), ...);
      TORCH_INTERNAL_ASSERT(written != nullptr, "aoti_eager: no written argument for ", override_->schema_->name());
      return *written;
    }
  }

  std::shared_ptr<OpOverride> override_;
  c10::BoxedKernel boxed_;
};

namespace {

// Whether the dispatcher passes a schema argument (or return) as `T`, as
// PyTorch's code generator declares it: a tensor it writes as `at::Tensor&`.
// The real type tells SymInt[] (c10::SymIntArrayRef) from int[].
template <class T>
bool passed_as(const c10::Argument& argument) {
  const c10::TypePtr& type = argument.real_type();
  const bool tensor = type->kind() == c10::TypeKind::TensorType;
  const bool written = argument.alias_info() != nullptr && argument.alias_info()->isWrite();
  if constexpr (std::is_same_v<T, at::Tensor&>) {
    return tensor && written;
  } else if constexpr (std::is_same_v<T, at::Tensor> || std::is_same_v<T, const at::Tensor&>) {
    return tensor && !written;
  } else if constexpr (std::is_same_v<T, const std::optional<at::Tensor>&>) {
    auto optional = type->cast<c10::OptionalType>();
    return optional && optional->getElementType()->kind() == c10::TypeKind::TensorType && !written;
  } else if constexpr (std::is_same_v<T, c10::SymIntArrayRef>) {
    auto list = type->cast<c10::ListType>();
    return list && list->getElementType()->kind() == c10::TypeKind::SymIntType;
  } else if constexpr (std::is_same_v<T, const c10::Scalar&>) {
    return type->kind() == c10::TypeKind::NumberType;
  } else if constexpr (std::is_same_v<T, c10::string_view>) {
    return type->kind() == c10::TypeKind::StringType;
  } else if constexpr (std::is_same_v<T, double>) {
    return type->kind() == c10::TypeKind::FloatType;
  } else if constexpr (std::is_same_v<T, int64_t>) {
    return type->kind() == c10::TypeKind::IntType;
  } else {
    static_assert(std::is_same_v<T, bool>);
    return type->kind() == c10::TypeKind::BoolType;
  }
}

// Whether the schema's returns are `Return`: one value, or a tuple's items.
template <class Return>
struct ReturnedAs {
  static bool matches(const std::vector<c10::Argument>& returns) {
    return returns.size() == 1 && passed_as<Return>(returns[0]);
  }
};
template <class... Items>
struct ReturnedAs<std::tuple<Items...>> {
  static bool matches(const std::vector<c10::Argument>& returns) {
    size_t i = 0;
    return returns.size() == sizeof...(Items) && (passed_as<Items>(returns[i++]) && ...);
  }
};

template <class Return, class... Args>
bool has_signature(const c10::FunctionSchema& schema, Return (*)(Args...)) {
  if (schema.arguments().size() != sizeof...(Args)) {
    return false;
  }
  size_t i = 0;
  return ReturnedAs<Return>::matches(schema.returns()) && (passed_as<Args>(schema.arguments()[i++]) && ...);
}

// The unboxed kernel for the first of `FuncTypes` that is the op's C++
// signature, with that signature; else the boxed one. The signatures of
// unary, binary and alpha-scaled pointwise ops and their in-place and out=
// forms, and of the ops of a transformer layer (addmm, gelu, layer norm,
// softmax): the small calls whose time the boxing shows in.
template <class FuncType, class... FuncTypes>
c10::KernelFunction override_kernel(
    const c10::FunctionSchema& schema,
    std::shared_ptr<OpOverride> override,
    std::optional<c10::impl::CppSignature>& signature) {
  if (has_signature(schema, static_cast<FuncType*>(nullptr))) {
    signature = c10::impl::CppSignature::make<FuncType>();
    return c10::KernelFunction::makeFromUnboxedFunctor<false, UnboxedOverride<FuncType>>(
        std::make_unique<UnboxedOverride<FuncType>>(std::move(override)));
  }
  if constexpr (sizeof...(FuncTypes) > 0) {
    return override_kernel<FuncTypes...>(schema, std::move(override), signature);
  } else {
    return c10::KernelFunction::makeFromBoxedFunctor(std::make_unique<WholeBoxedOverride>(std::move(override)));
  }
}

using Tensor = at::Tensor;
using Scalar = c10::Scalar;

} // namespace

Registration register_override(
    const std::string& op_name,
    const std::string& overload_name,
    c10::DispatchKey dispatch_key,
    std::shared_ptr<OpOverride> override) {
  c10::OperatorName name(op_name, overload_name);
  auto& dispatcher = c10::Dispatcher::singleton();
  const auto& schema = dispatcher.findSchemaOrThrow(op_name.c_str(), overload_name.c_str()).schema();
  std::optional<c10::impl::CppSignature> signature;
  c10::KernelFunction kernel = override_kernel<
      Tensor(const Tensor&),
      Tensor(const Tensor&, const Tensor&),
      Tensor(const Tensor&, const Scalar&),
      Tensor(const Tensor&, const Tensor&, const Scalar&),
      Tensor&(Tensor&),
      Tensor&(Tensor&, const Tensor&),
      Tensor&(Tensor&, const Scalar&),
      Tensor&(Tensor&, const Tensor&, const Scalar&),
      Tensor&(const Tensor&, Tensor&),
      Tensor&(const Tensor&, const Tensor&, Tensor&),
      Tensor&(const Tensor&, const Tensor&, const Scalar&, Tensor&),
      Tensor(const Tensor&, const Tensor&, const Tensor&, const Scalar&, const Scalar&),
      Tensor&(Tensor&, const Tensor&, const Tensor&, const Scalar&, const Scalar&),
      Tensor&(const Tensor&, const Tensor&, const Tensor&, const Scalar&, const Scalar&, Tensor&),
      Tensor(const Tensor&, c10::string_view),
      Tensor&(Tensor&, c10::string_view),
      Tensor&(const Tensor&, c10::string_view, Tensor&),
      Tensor(const Tensor&, int64_t, bool),
      std::tuple<Tensor, Tensor, Tensor>(
          const Tensor&, c10::SymIntArrayRef, const std::optional<Tensor>&, const std::optional<Tensor>&, double)>(
      schema, override, signature);
  const std::string debug = "aoti_eager override of " + c10::toString(name);
  if (signature) {
    try {
      return {
          std::make_unique<c10::RegistrationHandleRAII>(
              dispatcher.registerImpl(name, dispatch_key, std::move(kernel), signature, nullptr, debug)),
          /*unboxed=*/true};
    } catch (const c10::Error&) {
      // The dispatcher checks the C++ signature against the op's own. Those
      // that write a const Tensor& (resize_, the in-place views) are never
      // overridden; any other op declared otherwise is registered boxed.
    }
  }
  return {
      std::make_unique<c10::RegistrationHandleRAII>(dispatcher.registerImpl(
          name,
          dispatch_key,
          c10::KernelFunction::makeFromBoxedFunctor(std::make_unique<WholeBoxedOverride>(std::move(override))),
          std::nullopt,
          nullptr,
          debug)),
      /*unboxed=*/false};
}

} // namespace aoti_eager
