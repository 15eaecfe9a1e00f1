// Work sharing for the kernels' parallel loops: the threads claim chunks of [0, n) from a shared
// counter as they go (a dynamic schedule), instead of each taking a fixed 1/threads share.
//
// Why: a served engine shares its cores with the server's own threads (gRPC, responses) and the
// clients'; whichever kernel thread the OS pauses for them holds up the step with a fixed share,
// while with claimed chunks the other thread takes over the work it has not started. Chunks are
// several items long where items are small, so a thread still streams long runs of memory.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace tritonllm {

// Hands out [begin, end) ranges of `grain` items until [0, n) is used up.
class ClaimedChunks {
 public:
  ClaimedChunks(int64_t n, int64_t grain) : n_(n), grain_(std::max<int64_t>(grain, 1)) {}
  bool next(int64_t& begin, int64_t& end) {
    begin = next_.fetch_add(grain_, std::memory_order_relaxed);
    if (begin >= n_) return false;
    end = std::min(n_, begin + grain_);
    return true;
  }

 private:
  const int64_t n_, grain_;
  std::atomic<int64_t> next_{0};
};

// Runs `per_thread(chunks)` once on each of the pool's threads (fewer when there are fewer chunks);
// each call loops on `chunks.next(begin, end)`, so per-thread scratch lives in `per_thread`.
// Inside a parallel region, or with one thread, the caller's thread does everything.
template <typename PerThread>
void parallel_claim(int64_t n, int64_t grain, const PerThread& per_thread) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  ClaimedChunks chunks(n, grain);
  const int64_t num_chunks = (n + grain - 1) / grain;
  const int64_t threads = at::in_parallel_region() ? 1 : std::min<int64_t>(at::get_num_threads(), num_chunks);
  if (threads <= 1) {
    per_thread(chunks);
    return;
  }
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { per_thread(chunks); });
}

// A grain giving each thread about `chunks_per_thread` chunks of [0, n) (at least one item each).
inline int64_t grain_for(int64_t n, int64_t chunks_per_thread) {
  return std::max<int64_t>(1, n / (std::max<int64_t>(at::get_num_threads(), 1) * chunks_per_thread));
}

}  // namespace tritonllm
