#include "call_key.h"

#include <c10/util/hash.h>

#include <cstring>
#include <functional>

namespace aoti_eager {
namespace {

// One tag per argument kind, so that e.g. an int 2 and a double 2.0 differ.
enum Tag : int64_t {
  kNone = 1,
  kTensor,
  kUndefinedTensor,
  kWrappedNumber,
  kInt,
  kDouble,
  kBool,
  kString,
  kIntList,
  kDoubleList,
  kBoolList,
  kTensorList,
  kList,
  kDevice,
};

int64_t double_bits(double v) {
  int64_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits;
}

// Storages of the call's tensors, to find arguments that share memory.
using Storages = c10::SmallVector<const c10::StorageImpl*, 8>;

bool add_tensor(const at::Tensor& t, CallKey& key, Storages& storages) {
  if (!t.defined()) {
    key.words.push_back(kUndefinedTensor);
    return true;
  }
  // Layouts and lazily materialized views that the compiled kernels do not model.
  if (t.layout() != at::kStrided || t.is_conj() || t.is_neg() ||
      t.unsafeGetTensorImpl()->is_python_dispatch()) {
    return false;
  }
  if (t.unsafeGetTensorImpl()->is_wrapped_number()) {
    // A Python number that became a 0-d tensor: it promotes like a scalar and
    // its value is compiled into the kernel.
    key.words.push_back(kWrappedNumber);
    key.words.push_back(static_cast<int64_t>(t.scalar_type()));
    if (at::isFloatingType(t.scalar_type())) {
      key.words.push_back(double_bits(t.item<double>()));
    } else if (at::isIntegralType(t.scalar_type(), /*includeBool=*/true)) {
      key.words.push_back(t.item<int64_t>());
    } else {
      return false;
    }
    return true;
  }
  if (t.has_storage()) {
    // Borrowed: Tensor::storage() would copy the handle (two atomic updates).
    storages.push_back(t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl());
  }
  key.words.push_back(kTensor);
  key.words.push_back(static_cast<int64_t>(t.scalar_type()));
  key.words.push_back(static_cast<int64_t>(t.device().type()));
  key.words.push_back(t.device().index());
  key.words.push_back(t.dim());
  for (int64_t size : t.sizes()) {
    key.words.push_back(size);
  }
  for (int64_t stride : t.strides()) {
    key.words.push_back(stride);
  }
  key.words.push_back(is_aligned(t));
  return true;
}

bool add_value(const c10::IValue& v, CallKey& key, Storages& storages) {
  if (v.isTensor()) {
    return add_tensor(v.toTensor(), key, storages);
  }
  if (v.isNone()) {
    key.words.push_back(kNone);
  } else if (v.isInt()) {
    key.words.push_back(kInt);
    key.words.push_back(v.toInt());
  } else if (v.isDouble()) {
    key.words.push_back(kDouble);
    key.words.push_back(double_bits(v.toDouble()));
  } else if (v.isBool()) {
    key.words.push_back(kBool);
    key.words.push_back(v.toBool());
  } else if (v.isString()) {
    const auto& s = v.toStringRef();
    key.words.push_back(kString);
    key.words.push_back(static_cast<int64_t>(s.size()));
    key.words.push_back(static_cast<int64_t>(std::hash<std::string>{}(s)));
  } else if (v.isDevice()) {
    key.words.push_back(kDevice);
    key.words.push_back(static_cast<int64_t>(v.toDevice().type()));
    key.words.push_back(v.toDevice().index());
  } else if (v.isIntList()) {
    key.words.push_back(kIntList);
    auto list = v.toIntList();
    key.words.push_back(static_cast<int64_t>(list.size()));
    for (int64_t i : list) {
      key.words.push_back(i);
    }
  } else if (v.isDoubleList()) {
    key.words.push_back(kDoubleList);
    auto list = v.toDoubleList();
    key.words.push_back(static_cast<int64_t>(list.size()));
    for (double d : list) {
      key.words.push_back(double_bits(d));
    }
  } else if (v.isBoolList()) {
    key.words.push_back(kBoolList);
    auto list = v.toBoolList();
    key.words.push_back(static_cast<int64_t>(list.size()));
    for (bool b : list) {
      key.words.push_back(b);
    }
  } else if (v.isTensorList()) {
    key.words.push_back(kTensorList);
    auto list = v.toTensorList();
    key.words.push_back(static_cast<int64_t>(list.size()));
    for (const at::Tensor& t : list) {
      if (!add_tensor(t, key, storages)) {
        return false;
      }
    }
  } else if (v.isList()) {
    // Lists of mixed IValues: Tensor?[] (the indices of aten::index_put) and
    // Scalar[] (the scalars of aten::_foreach_add.ScalarList).
    key.words.push_back(kList);
    auto list = v.toListRef();
    key.words.push_back(static_cast<int64_t>(list.size()));
    for (const c10::IValue& item : list) {
      if (!add_value(item, key, storages)) {
        return false;
      }
    }
  } else {
    // Scalars of complex type, generators, streams, storages, ...
    return false;
  }
  return true;
}

} // namespace

bool compute_call_key(
    c10::ArrayRef<c10::IValue> args,
    bool mutates,
    CallKey& key) {
  key.words.clear();
  Storages storages;
  for (const c10::IValue& arg : args) {
    if (!add_value(arg, key, storages)) {
      return false;
    }
  }
  if (mutates) {
    // Kernels are compiled for arguments in separate memory; an op that
    // writes into one of them may not be handed overlapping ones.
    for (size_t i = 0; i < storages.size(); ++i) {
      for (size_t j = 0; j < i; ++j) {
        if (storages[i] == storages[j]) {
          return false;
        }
      }
    }
  }
  size_t h = key.words.size();
  for (int64_t w : key.words) {
    h = c10::hash_combine(h, static_cast<size_t>(w));
  }
  key.hash = h;
  return true;
}

} // namespace aoti_eager
