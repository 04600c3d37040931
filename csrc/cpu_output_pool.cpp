#include "cpu_output_pool.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <pthread.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <deque>
#include <mutex>
#include <utility>
#include <vector>

namespace aoti_eager {
namespace {

constexpr size_t kSmallest = 256;
constexpr size_t kSmallLargest = 64 * 1024;
constexpr size_t kLargest = size_t{1} << 40;
constexpr size_t kSlotsPerClass = 2;

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

constexpr size_t kSmallClasses = size_class(kSmallLargest).index + 1;
constexpr size_t kClasses = size_class(kLargest).index + 1;

constexpr size_t class_bytes(size_t index) {
  return index == 0 ? kSmallest : (4 + (index - 1) % 4 + 1) << ((index - 1) / 4 + 8 - 2);
}
static_assert(class_bytes(size_class(20480).index) == 20480 && class_bytes(size_class(kLargest).index) == kLargest);

std::array<std::array<std::atomic<void*>, kSlotsPerClass>, kSmallClasses> free_small{};

// Freed large blocks, oldest first. Never destroyed: tensors can be freed
// while the process exits, after static destructors ran.
struct LargeBlocks {
  std::mutex mutex;
  std::deque<std::pair<size_t, void*>> held; // (class, block)
  size_t held_bytes = 0;
  size_t limit = 0;

  // Gives back to c10 the oldest blocks past the limit (`mutex` held).
  std::vector<void*> trim() {
    std::vector<void*> dropped;
    while (held_bytes > limit) {
      held_bytes -= class_bytes(held.front().first);
      dropped.push_back(held.front().second);
      held.pop_front();
    }
    return dropped;
  }
};

LargeBlocks& large_blocks() {
  static LargeBlocks* blocks = [] {
    auto* b = new LargeBlocks();
    // A child forked while another thread held the lock would wait forever.
    pthread_atfork(
        [] { large_blocks().mutex.lock(); },
        [] { large_blocks().mutex.unlock(); },
        [] { large_blocks().mutex.unlock(); });
    return b;
  }();
  return *blocks;
}

void free_all(const std::vector<void*>& blocks) {
  for (void* block : blocks) {
    c10::free_cpu(block);
  }
}

void* take(size_t index) {
  if (index < kSmallClasses) {
    for (auto& slot : free_small[index]) {
      void* block = nullptr;
      if (slot.load(std::memory_order_relaxed) != nullptr &&
          (block = slot.exchange(nullptr, std::memory_order_acquire)) != nullptr) {
        return block;
      }
    }
    return nullptr;
  }
  LargeBlocks& large = large_blocks();
  std::lock_guard<std::mutex> guard(large.mutex);
  // The newest of its class: the likeliest to be in cache.
  for (auto it = large.held.rbegin(); it != large.held.rend(); ++it) {
    if (it->first == index) {
      void* block = it->second;
      large.held.erase(std::next(it).base());
      large.held_bytes -= class_bytes(index);
      return block;
    }
  }
  return nullptr;
}

// A block's deleter: back into the pool, else to c10.
template <size_t Class>
void give_back(void* block) {
  if constexpr (Class < kSmallClasses) {
    for (auto& slot : free_small[Class]) {
      void* empty = nullptr;
      if (slot.compare_exchange_strong(empty, block, std::memory_order_release, std::memory_order_relaxed)) {
        return;
      }
    }
    c10::free_cpu(block);
  } else {
    LargeBlocks& large = large_blocks();
    std::vector<void*> dropped;
    {
      std::lock_guard<std::mutex> guard(large.mutex);
      if (class_bytes(Class) > large.limit) {
        dropped.push_back(block);
      } else {
        large.held.emplace_back(Class, block);
        large.held_bytes += class_bytes(Class);
        dropped = large.trim();
      }
    }
    free_all(dropped); // outside the lock: unmapping takes a while
  }
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
    void* block = take(size.index);
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

void set_cpu_pool_limit(size_t bytes) {
  LargeBlocks& large = large_blocks();
  std::vector<void*> dropped;
  {
    std::lock_guard<std::mutex> guard(large.mutex);
    large.limit = bytes;
    dropped = large.trim();
  }
  free_all(dropped);
}

size_t cpu_pool_held_bytes() {
  LargeBlocks& large = large_blocks();
  std::lock_guard<std::mutex> guard(large.mutex);
  return large.held_bytes;
}

} // namespace aoti_eager
