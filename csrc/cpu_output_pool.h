#pragma once

// Memory for the outputs and buffers of CPU kernels: freed blocks are kept
// for the next allocation of their size class.
//
// A tiny call spent a large share of its time in glibc's memalign and free
// (chunk consolidation included) and c10's profiler checks, which blocks from
// here skip (BENCHMARKS.md, "Per-call dispatch"). A large one spent it in page
// faults: glibc maps every block above its mmap threshold (32 MiB at most)
// afresh and unmaps it when freed, so each new output of a model's logits
// touches fresh pages, as eager's do.
//
// Sizes come in classes four to a doubling (a block is 256 bytes, or at most
// a quarter larger than asked). Up to 64 KiB, two blocks are kept per class
// in lock-free slots: at most 830 KiB held. Above that, freed blocks are kept
// under a lock up to a byte limit (`set_cpu_pool_limit`; 0 keeps none), the
// oldest given back to c10 first. A block is handed out with the deleter of
// its class, so that any thread can free it; it keeps c10's alignment, and its
// data pointer is its context, as c10's own allocator's are (copy-on-write
// clones need that).

#include <c10/core/Allocator.h>

#include <cstddef>

namespace aoti_eager {

// The pool where c10's default CPU allocator is in use and nothing is
// profiling memory (torch.profiler's profile_memory sees every allocation);
// else c10's CPU allocator itself.
c10::Allocator* cpu_output_allocator();

// Whether `data` is a block of the pool.
bool from_cpu_output_pool(const c10::DataPtr& data);

// The most bytes of freed blocks above 64 KiB the pool keeps; blocks held
// past it go back to c10 now.
void set_cpu_pool_limit(size_t bytes);

// Bytes of freed blocks above 64 KiB the pool holds.
size_t cpu_pool_held_bytes();

} // namespace aoti_eager
