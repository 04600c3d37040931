#pragma once

// Memory for the outputs and buffers of CPU kernels: a few freed blocks of
// each small size are kept for the next allocation of that size.
//
// A tiny call spent a large share of its time in glibc's memalign and free
// (chunk consolidation included) and c10's profiler checks, which blocks from
// here skip (BENCHMARKS.md, "Per-call dispatch"). Eager pays glibc for every
// output.
//
// Blocks up to 64 KiB, in classes four to a doubling (a block is 256 bytes,
// or at most a quarter larger than asked), two kept per class: at most 830
// KiB held. A
// block is handed out with the deleter of its class, so that any thread can
// free it; it keeps c10's alignment, and its data pointer is its context, as
// c10's own allocator's are (copy-on-write clones need that).

#include <c10/core/Allocator.h>

namespace aoti_eager {

// The pool where c10's default CPU allocator is in use and nothing is
// profiling memory (torch.profiler's profile_memory sees every allocation);
// else c10's CPU allocator itself. Allocations above the pool's sizes go to
// c10's default allocator.
c10::Allocator* cpu_output_allocator();

// Whether `data` is a block of the pool.
bool from_cpu_output_pool(const c10::DataPtr& data);

} // namespace aoti_eager
