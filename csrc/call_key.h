#pragma once

// The in-process key of an op call: everything about its arguments that a
// compiled kernel was specialized on, read straight off the dispatcher stack.

#include <ATen/core/ivalue.h>
#include <c10/util/SmallVector.h>

#include <cstddef>
#include <cstdint>

namespace aoti_eager {

struct CallKey {
  c10::SmallVector<int64_t, 48> words;
  size_t hash = 0;

  bool operator==(const CallKey& other) const {
    return hash == other.hash && words == other.words;
  }
};

struct CallKeyHash {
  size_t operator()(const CallKey& key) const {
    return key.hash;
  }
};

// Fills `key` from the op's arguments. Returns false when an argument is of a
// kind no kernel is compiled for, or when an op that `mutates` its arguments
// gets two tensors sharing memory (the call then runs the original kernel).
// What it hashes, argument by argument, beside what the Python key of a cache
// entry hashes: the Keys section of kernels/signature.py.
bool compute_call_key(
    c10::ArrayRef<c10::IValue> args,
    bool mutates,
    CallKey& key);

// Inputs whose data pointer is 16-byte aligned may be read with aligned
// vector loads; a kernel compiled for them must not see a misaligned input.
inline bool is_aligned(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
}

} // namespace aoti_eager
