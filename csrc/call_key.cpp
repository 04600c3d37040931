#include "call_key.h"

#include <c10/util/hash.h>

#include <cstring>
#include <limits>
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

// Left where a dynamic dim's size would be.
constexpr int64_t kAnySize = std::numeric_limits<int64_t>::min();

struct KeyBuilder {
  CallKey& key;
  Storages storages;
  const DynamicDims* dynamic = nullptr;
  KeyedTensors* tensors = nullptr;
  size_t tensor_index = 0;
};

bool add_tensor(const at::Tensor& t, KeyBuilder& builder) {
  CallKey& key = builder.key;
  Storages& storages = builder.storages;
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
  const size_t index = builder.tensor_index++;
  const uint64_t dynamic =
      builder.dynamic != nullptr && index < builder.dynamic->size() ? (*builder.dynamic)[index] : 0;
  if (builder.tensors != nullptr) {
    builder.tensors->push_back(&t);
  }
  const auto sizes = t.sizes();
  for (size_t d = 0; d < sizes.size(); ++d) {
    key.words.push_back(d < 64 && (dynamic >> d) & 1 ? kAnySize : sizes[d]);
  }
  if (dynamic == 0) {
    // A size-1 dim's stride never moves through memory, and views give it
    // any value: kernels are keyed on the strides that step (as
    // kernels/signature.py's TensorArg is).
    const auto strides = t.strides();
    for (size_t d = 0; d < strides.size(); ++d) {
      key.words.push_back(sizes[d] == 1 ? kAnySize : strides[d]);
    }
  }
  key.words.push_back(is_aligned(t));
  return true;
}

bool add_value(const c10::IValue& v, KeyBuilder& builder) {
  CallKey& key = builder.key;
  if (v.isTensor()) {
    return add_tensor(v.toTensor(), builder);
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
      if (!add_tensor(t, builder)) {
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
      if (!add_value(item, builder)) {
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
    CallKey& key,
    const DynamicDims* dynamic,
    KeyedTensors* tensors) {
  key.words.clear();
  KeyBuilder builder{key, {}, dynamic, tensors};
  Storages& storages = builder.storages;
  for (const c10::IValue& arg : args) {
    if (!add_value(arg, builder)) {
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

bool ShapeGuards::admit(const KeyedTensors& tensors) const {
  c10::SmallVector<int64_t, 8> values(ranges.size(), -1);
  for (const Dim& guard : dims) {
    if (guard.tensor >= static_cast<int64_t>(tensors.size()) ||
        guard.dim >= tensors[guard.tensor]->dim()) {
      return false;
    }
    const int64_t size = tensors[guard.tensor]->sizes()[guard.dim];
    if (guard.symbol < 0) {
      if (size != guard.size) {
        return false;
      }
      continue;
    }
    int64_t& value = values[guard.symbol];
    if (value >= 0 ? size != value
                   : size < ranges[guard.symbol].first || size > ranges[guard.symbol].second) {
      return false;
    }
    value = size;
  }
  const auto count = static_cast<int64_t>(tensors.size());
  for (const Stride& rule : strides) {
    if (rule.tensor >= count || rule.dim >= tensors[rule.tensor]->dim()) {
      return false;
    }
    const at::Tensor& t = *tensors[rule.tensor];
    if (t.sizes()[rule.dim] == 1) {
      continue; // its index is always 0
    }
    int64_t expected = rule.scale;
    for (const auto& [tensor, dim] : rule.factors) {
      if (tensor >= count || dim >= tensors[tensor]->dim()) {
        return false;
      }
      expected *= tensors[tensor]->sizes()[dim];
    }
    if (t.strides()[rule.dim] != expected) {
      return false;
    }
  }
  for (const Order& order : orders) {
    if (order.tensor >= count) {
      return false;
    }
    const at::Tensor& t = *tensors[order.tensor];
    int64_t outer = std::numeric_limits<int64_t>::max();
    for (int64_t d : order.dims) {
      if (d >= t.dim()) {
        return false;
      }
      const int64_t stride = t.strides()[d];
      if (t.sizes()[d] == 1 || stride == 0) {
        continue;
      }
      if (stride >= outer) {
        return false;
      }
      outer = stride;
    }
  }
  for (const at::Tensor* t : tensors) {
    if (t->numel() > kMaxNumel) {
      return false;
    }
  }
  return true;
}

} // namespace aoti_eager
