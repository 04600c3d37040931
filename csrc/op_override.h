#pragma once

// The kernel that replaces one aten op at one dispatch key.
//
// Hit path (no Python, no GIL): key the call from its arguments, find the
// loaded kernel, run it, return its outputs. Ops of the common C++ signatures
// (register_override lists them) take their arguments unboxed, as the
// dispatcher holds them; every other op takes them boxed on its stack. Miss path: ask Python (the
// handler set with set_miss_handler) for a decision about the signature and
// remember it. Signatures decided "eager", arguments that cannot be keyed, and
// calls made while this thread is already inside aoti_eager (compiling, or
// running a compiled kernel that calls back into the dispatcher) run the
// original kernel, kept from before the override.

#include "call_key.h"
#include "compiled_kernel.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <pybind11/pybind11.h>

#include <array>
#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace aoti_eager {

using OriginalKernel = std::decay_t<decltype(std::declval<c10::OperatorHandle>()
                                                 .getComputedKernelForDispatchKey(
                                                     c10::DispatchKey::CPU))>;

// Each counted call adds to one of `hits` and `other_calls`: a hit pays for
// one atomic update, not two.
struct Counters {
  std::atomic<uint64_t> hits{0};
  std::atomic<uint64_t> other_calls{0};
  std::atomic<uint64_t> misses{0};
  std::atomic<uint64_t> eager_calls{0};
  // Calls of an unboxed override (from outside aoti_eager) that took the
  // boxed path: its misses, and calls it could not key or serve unboxed.
  std::atomic<uint64_t> boxed_calls{0};

  uint64_t calls() const {
    return hits.load() + other_calls.load();
  }
};

class OpOverride : public std::enable_shared_from_this<OpOverride> {
 public:
  // `token` identifies this override to the Python miss handler.
  OpOverride(
      const c10::OperatorHandle& op,
      c10::DispatchKey dispatch_key,
      int64_t token);

  void call(
      const c10::OperatorHandle& op,
      c10::DispatchKeySet keys,
      torch::jit::Stack* stack);

  const Counters& counters() const {
    return counters_;
  }

  void reset_counters();

  // Forgets every decision (kernels and eager); the next call of each
  // signature misses again.
  void clear();

  size_t num_entries() const;

 private:
  template <class FuncType>
  friend class UnboxedOverride;

  // A decision as the hit path reads it from hot_ without the lock: its key
  // and kernel stay until the override goes, so that no call copies a
  // shared_ptr (two atomic updates) nor takes mutex_ (two more).
  struct HotEntry {
    CallKey key;
    const CompiledKernel* kernel; // null: run eagerly
  };

  struct Entry {
    std::shared_ptr<const CompiledKernel> kernel; // null: run eagerly
    // Set: run eagerly until then, then miss again (a compile elsewhere has
    // not ended); a call that went to Python instead cost 87 times eager's.
    std::chrono::steady_clock::time_point retry_at{};
    const HotEntry* hot = nullptr; // the entry in hot_ form, if it has one
  };

  // What a call runs: `kernel`, or eagerly where it is null.
  struct Decision {
    const CompiledKernel* kernel = nullptr;
    std::shared_ptr<const CompiledKernel> owner; // keeps `kernel` where hot_ does not
  };

  // Dynamic kernels whose dynamic dims are the same: keyed by the family key
  // (compute_call_key with `dims`), each with the guards it was compiled for
  // (one key may hold kernels of several layouts).
  struct DynamicEntry {
    std::shared_ptr<const CompiledKernel> kernel; // null: the family runs eagerly
    ShapeGuards guards;
    // Judged against eager per range of sizes (ShapeGuards::admit's): the
    // ranges judged, each with whether the kernel runs there (else eager);
    // a call in another range misses, and is judged.
    bool per_range = false;
    c10::SmallVector<std::pair<uint64_t, bool>, 4> ranges;
  };
  struct Family {
    DynamicDims dims;
    RuntimeNumbers runtime; // numbers whose values the family's key leaves out
    std::unordered_map<CallKey, c10::SmallVector<DynamicEntry, 1>, CallKeyHash> kernels;
  };

  void run_original(
      const c10::OperatorHandle& op,
      c10::DispatchKeySet keys,
      torch::jit::Stack* stack);
  void run_kernel(const CompiledKernel& kernel, torch::jit::Stack* stack);
  // `add_arguments(CallKeyBuilder&)` adds the call's arguments to a key,
  // boxed or unboxed; false where one cannot be keyed.
  template <class AddArguments>
  bool compute_key(const AddArguments& add_arguments, CallKey& key) const;
  // The decision for the call: its key's, else that of a family whose key
  // and guards it matches (a dynamic kernel, or eager for a family that
  // compiles no more); nullopt for a miss.
  template <class AddArguments>
  std::optional<Decision> find(const CallKey& key, const AddArguments& add_arguments) const;
  std::optional<Entry> lookup(const CallKey& key) const;
  // The slot of hot_ for `key`: a few of its words mixed, cheaper than its hash.
  static size_t hot_slot(const CallKey& key);
  // Makes `entry` (of `key`, under the unique lock) readable from hot_.
  void make_hot(const CallKey& key, Entry& entry);
  // Keeps `kernel` (null: eager) for the call's family, where its guards
  // admit the call: the calls that differ from it in the sizes of
  // `dynamic`'s dims (None: none), and in the values of its `runtime` numbers.
  // Where `judged` (a CompiledKernel) is given, for the call's range of sizes
  // only, as the verdict on that dynamic kernel.
  void add_family(
      c10::ArrayRef<c10::IValue> args,
      std::shared_ptr<const CompiledKernel> kernel,
      const pybind11::handle& dynamic,
      RuntimeNumbers runtime,
      const pybind11::handle& judged);
  // The family of `dims` and `runtime` (under the unique lock), made where
  // there is none; families with fewer dynamic dims come first.
  Family& family_of(DynamicDims dims, RuntimeNumbers runtime);
  // Records (under the unique lock) whether the `judged` dynamic kernel runs
  // in the call's `size_range`, or eager does there.
  void add_range_verdict(
      c10::SmallVector<DynamicEntry, 1>& entries,
      std::shared_ptr<const CompiledKernel> judged,
      ShapeGuards guards,
      uint64_t size_range,
      bool use_kernel);
  // A dynamic kernel's dims and guards, as kernels/dynamic.py's ShapeFamily gives them.
  static void read_guards(const pybind11::handle& dynamic, DynamicDims& dims, ShapeGuards& guards);
  // Returns nullopt when this one call must run eagerly without remembering.
  std::optional<Entry> on_miss(
      const CallKey& key,
      torch::jit::Stack* stack,
      bool remember = true);

  const c10::OperatorHandle op_;
  OriginalKernel original_;
  const c10::FunctionSchema* schema_; // owned by the dispatcher, lives forever
  const int64_t token_;
  const size_t num_arguments_;
  const bool mutates_;
  // For each return: the index of the argument it aliases (in-place and out=
  // ops return their mutated argument), or -1.
  std::vector<int64_t> return_aliases_;

  static constexpr size_t kMaxEntries = 4096;
  // hot_[hot_slot(key)]: the entry of that slot's last key decided or
  // looked up, or null. Entries whose retry time has not come are not hot.
  static constexpr size_t kHotSlots = 16;
  // Hot entries are never freed before the override: bounded, for keys that
  // carry a runtime number's value (a new key per value).
  static constexpr size_t kMaxHotEntries = 256;
  mutable std::array<std::atomic<const HotEntry*>, kHotSlots> hot_{};
  std::vector<std::unique_ptr<const HotEntry>> hot_entries_; // under mutex_
  std::vector<std::shared_ptr<const CompiledKernel>> hot_kernels_; // under mutex_
  mutable std::shared_mutex mutex_;
  std::unordered_map<CallKey, Entry, CallKeyHash> entries_;
  // Narrowest first: a kernel with fewer dynamic dims knows more of the call.
  std::vector<Family> families_;
  std::atomic<bool> has_families_{false};
  Counters counters_;
  std::atomic<bool> reported_unkeyable_{false};
};

// Python's positions of runtime numbers (CallSignature.runtime_arguments):
// an argument's index, or an (argument, item) pair for an item of a list.
RuntimeNumbers runtime_numbers(const pybind11::iterable& positions);

struct Registration {
  std::unique_ptr<c10::RegistrationHandleRAII> handle; // dropping it restores the original kernel
  bool unboxed; // registered with the op's C++ signature, not boxed
};

// Registers `override` as the kernel of its op at `dispatch_key`.
Registration register_override(
    const std::string& op_name,
    const std::string& overload_name,
    c10::DispatchKey dispatch_key,
    std::shared_ptr<OpOverride> override);

// handler(token, args: list, decide: bool) -> decision, an object with these
// attributes (aoti_eager/_runtime.py: UseKernel, RunEagerly, RetryLater):
//   remember: bool  keep the decision for the call's key; false: run this
//                   call eagerly and ask again on the next, or, where the
//                   decision's retry_after (seconds) is above 0, on the
//                   first call after that time
//   kernel:         the CompiledKernel to run, or None for the original kernel
//   dynamic:        None, or the kernel's dynamic dims and guards
//                   (kernels/dynamic.py: ShapeFamily): the kernel (or eager,
//                   for a family that compiles no more) then also serves every
//                   later call of its family that the guards admit
//   numbers:        of an eager decision, the positions of the numbers
//                   whose values it holds for (a kernel's are its runtime
//                   numbers): later calls that differ only in them do not miss
//   judged:         None, or the dynamic kernel this decision was judged for
//                   in the call's range of sizes only (the kernel, or eager
//                   where it lost there): calls in other ranges miss
// With decide false the call's arguments cannot be keyed: the handler only
// records why, and the call runs eagerly whatever it returns.
void set_miss_handler(pybind11::object handler);

// Runs the original kernels for the rest of the scope on this thread.
class ReentryGuard {
 public:
  ReentryGuard();
  // With the thread's depth() already looked up (a call into the dynamic
  // loader for a thread_local of a library loaded at run time).
  explicit ReentryGuard(int& depth) : depth_(depth) {
    ++depth_;
  }
  ~ReentryGuard() {
    --depth_;
  }
  ReentryGuard(const ReentryGuard&) = delete;
  ReentryGuard& operator=(const ReentryGuard&) = delete;
  static bool active() {
    return depth() > 0;
  }
  // How deep this thread is inside aoti_eager: 0 outside.
  static int& depth();

 private:
  int& depth_;
};

} // namespace aoti_eager
