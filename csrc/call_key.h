#pragma once

// The in-process key of an op call: everything about its arguments that a
// compiled kernel was specialized on, read straight off the dispatcher stack.

#include <ATen/core/ivalue.h>
#include <c10/core/SymIntArrayRef.h>
#include <c10/util/SmallVector.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace aoti_eager {

// A number that a kernel takes at run time instead of a compiled-in value:
// the op's argument `argument`, or with `item` >= 0, that item of the list
// given for it.
struct RuntimeNumber {
  int64_t argument;
  int64_t item = -1;

  bool operator==(const RuntimeNumber& other) const {
    return argument == other.argument && item == other.item;
  }
};

// Runtime numbers in argument order, and item order within a list.
using RuntimeNumbers = std::vector<RuntimeNumber>;

struct CallKey {
  c10::SmallVector<int64_t, 48> words;

  bool operator==(const CallKey& other) const {
    return words == other.words;
  }
};

// Hashed where a table looks a key up, not on every call: a hit of the
// override's hot entries (csrc/op_override.h) compares the words alone.
struct CallKeyHash {
  size_t operator()(const CallKey& key) const;
};

// The dims a dynamic kernel takes at any size: for each tensor argument, in
// the order the key meets them (lists included, wrapped numbers not), a bit
// per dim. Tensors past its end have none.
using DynamicDims = c10::SmallVector<uint64_t, 4>;

// The call's tensor arguments in that order, for checking a dynamic kernel's
// guards.
using KeyedTensors = c10::SmallVector<const at::Tensor*, 8>;

// Fills a CallKey argument by argument: compute_call_key from the boxed
// arguments of a dispatcher stack, an unboxed kernel from its C++ arguments
// (csrc/op_override.cpp), so that both find the same entries. What it hashes,
// argument by argument, beside what the Python key of a cache entry hashes:
// the Keys section of kernels/signature.py.
//
// With `dynamic`, the key of a dynamic kernel's family: each dynamic dim's
// size is left out, and so are the strides of a tensor with one (its kernel's
// ShapeGuards check them); `tensors` receives the tensor arguments.
// With `runtime`, the value of each number at those positions is left out
// where a kernel may take it at run time (a finite float, an int above 0):
// one key for every value a kernel with those runtime numbers serves.
class CallKeyBuilder {
 public:
  explicit CallKeyBuilder(
      CallKey& key,
      const DynamicDims* dynamic = nullptr,
      KeyedTensors* tensors = nullptr,
      const RuntimeNumbers* runtime = nullptr)
      : key_(key), dynamic_(dynamic), tensors_(tensors), runtime_(runtime != nullptr && !runtime->empty() ? runtime : nullptr) {
    key_.words.clear();
  }

  // Each adds the call's next argument; false for one of a kind no kernel
  // is compiled for.
  bool add(const c10::IValue& arg) {
    return next_argument(add_value(arg));
  }
  bool add(const at::Tensor& arg) {
    return next_argument(add_tensor(arg));
  }
  // As the dispatcher boxes a Scalar: an int, a double or a bool.
  bool add(const c10::Scalar& arg) {
    return next_argument(add_scalar(arg));
  }
  // The other C++ types of unboxed overrides, each as add_value keys the
  // IValue the dispatcher boxes it into.
  bool add(int64_t arg) {
    add_int(arg);
    return next_argument(true);
  }
  bool add(double arg) {
    add_double(arg);
    return next_argument(true);
  }
  bool add(bool arg) {
    add_bool(arg);
    return next_argument(true);
  }
  bool add(std::string_view arg) {
    add_string(arg);
    return next_argument(true);
  }
  bool add(const std::optional<at::Tensor>& arg) {
    if (!arg.has_value()) {
      add_none();
      return next_argument(true);
    }
    return next_argument(add_tensor(*arg));
  }
  // An int list where no item is symbolic (else a SymInt list, never keyed).
  bool add(c10::SymIntArrayRef arg) {
    return next_argument(add_int_list(arg));
  }

  // Returns false when an op that `mutates` its arguments got two tensors
  // sharing memory (the call then runs the original kernel).
  bool finish(bool mutates);

 private:
  bool next_argument(bool added) {
    ++argument_;
    item_ = -1;
    return added;
  }
  bool add_value(const c10::IValue& arg);
  bool add_tensor(const at::Tensor& arg);
  bool add_scalar(const c10::Scalar& arg);
  void add_int(int64_t value);
  void add_double(double value);
  void add_bool(bool value);
  void add_string(std::string_view value);
  void add_none();
  // The size of an int list, then add_list_int of each item.
  void add_int_list_size(size_t size);
  void add_list_int(int64_t value);
  bool add_int_list(c10::SymIntArrayRef list);
  // Whether the number at the current position is one of `runtime_`.
  bool at_runtime_number();

  CallKey& key_;
  const DynamicDims* dynamic_;
  KeyedTensors* tensors_;
  const RuntimeNumbers* runtime_;
  size_t tensor_index_ = 0;
  int64_t argument_ = 0;
  int64_t item_ = -1; // in a list: the item's index
  size_t next_runtime_ = 0; // the first of `runtime_` not behind the position
  // Storages of the call's tensors, to find arguments that share memory.
  c10::SmallVector<const c10::StorageImpl*, 8> storages_;
};

inline bool compute_call_key(
    c10::ArrayRef<c10::IValue> args,
    bool mutates,
    CallKey& key,
    const DynamicDims* dynamic = nullptr,
    KeyedTensors* tensors = nullptr,
    const RuntimeNumbers* runtime = nullptr) {
  CallKeyBuilder builder(key, dynamic, tensors, runtime);
  for (const c10::IValue& arg : args) {
    if (!builder.add(arg)) {
      return false;
    }
  }
  return builder.finish(mutates);
}

// What a dynamic kernel was compiled for beyond its family's key, as
// torch.export recorded it (kernels/dynamic.py builds them): each dynamic dim
// is either one of the kernel's symbols, within the symbol's range, with dims
// of one symbol equal, or a size export specialized it to; each stride of a
// tensor with a dynamic dim is a product of sizes, or read at run time from
// a tensor whose dims step through memory in the order it was compiled for.
struct ShapeGuards {
  struct Dim {
    int64_t tensor;
    int64_t dim;
    int64_t symbol; // < 0: the dim must be `size`
    int64_t size;
  };
  // Unless the dim's size is 1: its stride is `scale` times the sizes of `factors`.
  struct Stride {
    int64_t tensor;
    int64_t dim;
    int64_t scale;
    c10::SmallVector<std::pair<int64_t, int64_t>, 2> factors; // (tensor, dim)
  };
  // The tensor's dims of size > 1 and stride > 0 have falling strides in `dims`' order.
  struct Order {
    int64_t tensor;
    c10::SmallVector<int64_t, 4> dims;
  };
  std::vector<Dim> dims;
  std::vector<std::pair<int64_t, int64_t>> ranges; // per symbol: [min, max]
  std::vector<Stride> strides;
  std::vector<Order> orders;
  // Off for a kernel of fixed sizes, whose family is its values' (RuntimeNumbers).
  bool limit_numel = true;
  // Kernels index their dynamic tensors with 32-bit math up to this many elements.
  static constexpr int64_t kMaxNumel = (int64_t{1} << 31) - 1;

  // With `size_range`: the call's range of sizes, each symbol's power of two
  // (kernels/dynamic.py: ShapeFamily.size_range), as one word.
  bool admit(const KeyedTensors& tensors, uint64_t* size_range = nullptr) const;
};

// Inputs whose data pointer is 16-byte aligned may be read with aligned
// vector loads; a kernel compiled for them must not see a misaligned input.
inline bool is_aligned(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
}

} // namespace aoti_eager
