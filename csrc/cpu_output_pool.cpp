#include "cpu_output_pool.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <utility>

namespace aoti_eager {
namespace {

constexpr size_t kSmallest = 256;
constexpr size_t kLargest = 64 * 1024;
constexpr size_t kSlotsPerClass = 2;
// 256 bytes, then four classes for each doubling up to 64 KiB.
constexpr size_t kClasses = 1 + 4 * (16 - 8);

struct SizeClass {
  size_t index;
  size_t bytes;
};

// For 2^k < n <= 2^(k+1): n rounded up to a multiple of 2^(k-2).
constexpr SizeClass size_class(size_t n) {
  if (n <= kSmallest) {
    return {0, kSmallest};
  }
  const int k = 63 - __builtin_clzll(n - 1);
  const size_t quarters = (n + (size_t{1} << (k - 2)) - 1) >> (k - 2); // 5 to 8
  return {1 + 4 * (k - 8) + (quarters - 5), quarters << (k - 2)};
}
static_assert(size_class(257).bytes == 320 && size_class(16384).bytes == 16384 && size_class(16385).bytes == 20480);
static_assert(size_class(kLargest).index == kClasses - 1);

std::array<std::array<std::atomic<void*>, kSlotsPerClass>, kClasses> free_blocks{};

// A block's deleter: back into a free slot of its class, else to c10.
template <size_t Class>
void give_back(void* block) {
  for (auto& slot : free_blocks[Class]) {
    void* empty = nullptr;
    if (slot.compare_exchange_strong(empty, block, std::memory_order_release, std::memory_order_relaxed)) {
      return;
    }
  }
  c10::free_cpu(block);
}

template <size_t... Classes>
constexpr std::array<c10::DeleterFnPtr, kClasses> deleters(std::index_sequence<Classes...>) {
  return {&give_back<Classes>...};
}
constexpr std::array<c10::DeleterFnPtr, kClasses> kDeleters = deleters(std::make_index_sequence<kClasses>());

class CpuOutputPool final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (n == 0 || n > kLargest) {
      return c10::GetDefaultCPUAllocator()->allocate(n);
    }
    const SizeClass size = size_class(n);
    void* block = nullptr;
    for (auto& slot : free_blocks[size.index]) {
      if (slot.load(std::memory_order_relaxed) != nullptr &&
          (block = slot.exchange(nullptr, std::memory_order_acquire)) != nullptr) {
        break;
      }
    }
    if (block == nullptr) {
      block = c10::alloc_cpu(size.bytes);
    }
    return {block, block, kDeleters[size.index], c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CpuOutputPool pool;

} // namespace

c10::Allocator* cpu_output_allocator() {
  c10::Allocator* allocator = c10::GetCPUAllocator();
  if (allocator != c10::GetDefaultCPUAllocator() || c10::memoryProfilingEnabled() ||
      FLAGS_caffe2_report_cpu_memory_usage) {
    return allocator;
  }
  return &pool;
}

bool from_cpu_output_pool(const c10::DataPtr& data) {
  return std::find(kDeleters.begin(), kDeleters.end(), data.get_deleter()) != kDeleters.end();
}

} // namespace aoti_eager
