#include "call_key.h"

#include <c10/util/hash.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <functional>
#include <string_view>

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
  // A runtime number's kind, its value left out (CallKeyBuilder's `runtime`).
  kAnyInt,
  kAnyDouble,
  kAnyWrappedNumber,
};

int64_t double_bits(double v) {
  int64_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits;
}

// Left where a dynamic dim's size would be.
constexpr int64_t kAnySize = std::numeric_limits<int64_t>::min();

} // namespace

bool CallKeyBuilder::at_runtime_number() {
  if (runtime_ == nullptr) {
    return false;
  }
  const RuntimeNumbers& runtime = *runtime_;
  // Both in argument and item order: one pass over the call meets them in turn.
  auto behind = [&](const RuntimeNumber& r) {
    return r.argument < argument_ || (r.argument == argument_ && r.item < item_);
  };
  while (next_runtime_ < runtime.size() && behind(runtime[next_runtime_])) {
    ++next_runtime_;
  }
  if (next_runtime_ < runtime.size() && runtime[next_runtime_] == RuntimeNumber{argument_, item_}) {
    ++next_runtime_;
    return true;
  }
  return false;
}

void CallKeyBuilder::add_int(int64_t value) {
  // 0 and below are compiled in (kernels/signature.py: can_be_runtime_int).
  if (value >= 1 && at_runtime_number()) {
    key_.words.push_back(kAnyInt);
    return;
  }
  key_.words.push_back(kInt);
  key_.words.push_back(value);
}

void CallKeyBuilder::add_double(double value) {
  // inf and nan are compiled in (kernels/signature.py: can_be_runtime).
  if (std::isfinite(value) && at_runtime_number()) {
    key_.words.push_back(kAnyDouble);
    return;
  }
  key_.words.push_back(kDouble);
  key_.words.push_back(double_bits(value));
}

void CallKeyBuilder::add_bool(bool value) {
  key_.words.push_back(kBool);
  key_.words.push_back(value);
}

void CallKeyBuilder::add_string(std::string_view value) {
  key_.words.push_back(kString);
  key_.words.push_back(static_cast<int64_t>(value.size()));
  key_.words.push_back(static_cast<int64_t>(std::hash<std::string_view>{}(value)));
}

void CallKeyBuilder::add_none() {
  key_.words.push_back(kNone);
}

void CallKeyBuilder::add_int_list_size(size_t size) {
  key_.words.push_back(kIntList);
  key_.words.push_back(static_cast<int64_t>(size));
}

void CallKeyBuilder::add_list_int(int64_t value) {
  if (runtime_ == nullptr) {
    key_.words.push_back(value);
  } else {
    ++item_;
    add_int(value);
  }
}

bool CallKeyBuilder::add_int_list(c10::SymIntArrayRef list) {
  // As c10::IValue's constructor from a SymInt[]: an int list unless an item
  // is symbolic.
  const std::optional<c10::IntArrayRef> ints = c10::asIntArrayRefSlowOpt(list);
  if (!ints) {
    return false;
  }
  add_int_list_size(ints->size());
  for (int64_t i : *ints) {
    add_list_int(i);
  }
  return true;
}

bool CallKeyBuilder::add_tensor(const at::Tensor& t) {
  auto& words = key_.words;
  if (!t.defined()) {
    words.push_back(kUndefinedTensor);
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
    if (at::isFloatingType(t.scalar_type())) {
      const double value = t.item<double>();
      const bool any = std::isfinite(value) && at_runtime_number();
      words.push_back(any ? kAnyWrappedNumber : kWrappedNumber);
      words.push_back(static_cast<int64_t>(t.scalar_type()));
      if (!any) {
        words.push_back(double_bits(value));
      }
      return true;
    }
    if (!at::isIntegralType(t.scalar_type(), /*includeBool=*/true)) {
      return false;
    }
    words.push_back(kWrappedNumber);
    words.push_back(static_cast<int64_t>(t.scalar_type()));
    words.push_back(t.item<int64_t>());
    return true;
  }
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  // Borrowed: Tensor::storage() would copy the handle (two atomic updates);
  // and read in place, as has_storage() and data_ptr() are calls into libc10.
  const c10::StorageImpl* storage = impl->unsafe_storage().unsafeGetStorageImpl();
  if (storage != nullptr) {
    storages_.push_back(storage);
  }
  const auto sizes = impl->sizes();
  const size_t ndim = sizes.size();
  // data_ptr(), as is_aligned reads it: null for an empty tensor.
  const bool aligned = storage != nullptr && impl->dtype_initialized() && !impl->has_symbolic_sizes_strides()
      ? impl->numel() == 0 ||
          (reinterpret_cast<uintptr_t>(storage->data()) + impl->itemsize() * impl->storage_offset()) % 16 == 0
      : is_aligned(t);
  const size_t index = tensor_index_++;
  const uint64_t dynamic =
      dynamic_ != nullptr && index < dynamic_->size() ? (*dynamic_)[index] : 0;
  if (tensors_ != nullptr) {
    tensors_->push_back(&t);
  }
  // Written in place: one size check for the tensor's words, not one per word.
  const size_t start = words.size();
  words.resize_for_overwrite(start + 1 + (dynamic == 0 ? 2 : 1) * ndim);
  int64_t* word = words.data() + start;
  // One word for all but sizes and strides: the key of a 64x64 add is 12
  // words instead of 22, hashed and compared on every call.
  const c10::Device device = impl->device();
  *word++ = kTensor | static_cast<int64_t>(t.scalar_type()) << 8 |
      static_cast<int64_t>(static_cast<uint8_t>(device.type())) << 16 |
      static_cast<int64_t>(static_cast<uint8_t>(device.index())) << 24 |
      static_cast<int64_t>(ndim) << 32 | static_cast<int64_t>(aligned) << 48;
  for (size_t d = 0; d < ndim; ++d) {
    *word++ = d < 64 && (dynamic >> d) & 1 ? kAnySize : sizes[d];
  }
  if (dynamic == 0) {
    // A size-1 dim's stride never moves through memory, and views give it
    // any value: kernels are keyed on the strides that step (as
    // kernels/signature.py's TensorArg is).
    const auto strides = impl->strides();
    for (size_t d = 0; d < ndim; ++d) {
      *word++ = sizes[d] == 1 ? kAnySize : strides[d];
    }
  }
  return true;
}

bool CallKeyBuilder::add_scalar(const c10::Scalar& s) {
  // In the order of c10::IValue's constructor from a Scalar.
  if (s.isSymbolic() || s.isComplex()) {
    return false;
  }
  if (s.isFloatingPoint()) {
    add_double(s.toDouble());
  } else if (s.isBoolean()) {
    key_.words.push_back(kBool);
    key_.words.push_back(s.toBool());
  } else {
    add_int(s.toLong());
  }
  return true;
}

bool CallKeyBuilder::add_value(const c10::IValue& v) {
  auto& words = key_.words;
  if (v.isTensor()) {
    return add_tensor(v.toTensor());
  }
  if (v.isNone()) {
    add_none();
  } else if (v.isInt()) {
    add_int(v.toInt());
  } else if (v.isDouble()) {
    add_double(v.toDouble());
  } else if (v.isBool()) {
    add_bool(v.toBool());
  } else if (v.isString()) {
    add_string(v.toStringRef());
  } else if (v.isDevice()) {
    words.push_back(kDevice);
    words.push_back(static_cast<int64_t>(v.toDevice().type()));
    words.push_back(v.toDevice().index());
  } else if (v.isIntList()) {
    auto list = v.toIntList();
    add_int_list_size(list.size());
    for (int64_t i : list) {
      add_list_int(i);
    }
  } else if (v.isDoubleList()) {
    words.push_back(kDoubleList);
    auto list = v.toDoubleList();
    words.push_back(static_cast<int64_t>(list.size()));
    for (double d : list) {
      if (runtime_ == nullptr) {
        words.push_back(double_bits(d));
      } else {
        ++item_;
        add_double(d);
      }
    }
  } else if (v.isBoolList()) {
    words.push_back(kBoolList);
    auto list = v.toBoolList();
    words.push_back(static_cast<int64_t>(list.size()));
    for (bool b : list) {
      words.push_back(b);
    }
  } else if (v.isTensorList()) {
    words.push_back(kTensorList);
    auto list = v.toTensorList();
    words.push_back(static_cast<int64_t>(list.size()));
    for (const at::Tensor& t : list) {
      if (!add_tensor(t)) {
        return false;
      }
    }
  } else if (v.isList()) {
    // Lists of mixed IValues: Tensor?[] (the indices of aten::index_put) and
    // Scalar[] (the scalars of aten::_foreach_add.ScalarList).
    words.push_back(kList);
    auto list = v.toListRef();
    words.push_back(static_cast<int64_t>(list.size()));
    for (const c10::IValue& item : list) {
      ++item_;
      if (!add_value(item)) {
        return false;
      }
    }
  } else {
    // Scalars of complex type, generators, streams, storages, ...
    return false;
  }
  return true;
}

bool CallKeyBuilder::finish(bool mutates) {
  if (mutates) {
    // Kernels are compiled for arguments in separate memory; an op that
    // writes into one of them may not be handed overlapping ones.
    for (size_t i = 0; i < storages_.size(); ++i) {
      for (size_t j = 0; j < i; ++j) {
        if (storages_[i] == storages_[j]) {
          return false;
        }
      }
    }
  }
  return true;
}

size_t CallKeyHash::operator()(const CallKey& key) const {
  size_t h = key.words.size();
  for (int64_t w : key.words) {
    h = c10::hash_combine(h, static_cast<size_t>(w));
  }
  return h;
}

bool ShapeGuards::admit(const KeyedTensors& tensors, uint64_t* size_range) const {
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
    if (limit_numel && t->numel() > kMaxNumel) {
      return false;
    }
  }
  if (size_range != nullptr) {
    // Each symbol's bit length (ShapeFamily.size_range), mixed into one word.
    uint64_t mixed = 0;
    for (int64_t value : values) {
      const uint64_t bits = value > 0 ? 64 - __builtin_clzll(static_cast<uint64_t>(value)) : 0;
      mixed = mixed * 0x9E3779B97F4A7C15ULL + bits + 1;
    }
    *size_range = mixed;
  }
  return true;
}

} // namespace aoti_eager
