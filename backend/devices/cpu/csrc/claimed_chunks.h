// Work sharing for the kernels' parallel loops: the threads claim chunks of [0, n) as they go (a
// dynamic schedule), instead of each taking a fixed 1/threads share.
//
// Why: a served engine shares its cores with the server's own threads (gRPC, responses) and the
// clients'; whichever kernel thread the OS pauses for them holds up the step with a fixed share,
// while with claimed chunks the other thread takes over the work it has not started.
//
// Two orders. `kInOrder`: one counter hands out the chunks in the items' order, for items sorted by
// cost (attention's longest contexts first). `kOwnRuns`: each thread claims chunks from the front of
// a contiguous run of its own (1/threads of [0, n)), and once that is done takes chunks from the back
// of the others' runs. A GEMM's items are consecutive panels, laid out one after another in memory, so
// a thread's claims follow on in memory and its prefetches run ahead into its next chunk; with one
// counter each chunk starts cold where another thread's left off.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace tritonllm {

enum class ClaimOrder { kInOrder, kOwnRuns };

// Hands out [begin, end) ranges of `grain` items until [0, n) is used up (see ClaimOrder).
class ClaimedChunks {
 public:
  ClaimedChunks(int64_t n, int64_t grain, int64_t threads, ClaimOrder order)
      : n_(n), grain_(std::max<int64_t>(grain, 1)), runs_(order == ClaimOrder::kOwnRuns ? std::max<int64_t>(threads, 1) : 1),
        state_(new std::atomic<uint64_t>[runs_]) {
    const int64_t chunks = (n_ + grain_ - 1) / grain_;
    for (int64_t r = 0; r < runs_; ++r) state_[r].store(pack(chunks * r / runs_, chunks * (r + 1) / runs_));
  }

  // The calling thread's view: it claims from run `thread` first.
  class Claimer {
   public:
    Claimer(ClaimedChunks& chunks, int64_t thread) : chunks_(chunks), own_(thread % chunks.runs_) {}
    bool next(int64_t& begin, int64_t& end) {
      int64_t chunk;
      if (!chunks_.take(own_, /*front=*/true, chunk)) {
        bool found = false;
        for (int64_t i = 1; i < chunks_.runs_ && !found; ++i) found = chunks_.take((own_ + i) % chunks_.runs_, false, chunk);
        if (!found) return false;
      }
      begin = chunk * chunks_.grain_;
      end = std::min(chunks_.n_, begin + chunks_.grain_);
      return true;
    }

   private:
    ClaimedChunks& chunks_;
    const int64_t own_;
  };

 private:
  // A run's unclaimed chunks [front, back), both in one word so that its owner (at the front) and a
  // thief (at the back) never take the same chunk.
  static uint64_t pack(int64_t front, int64_t back) { return (static_cast<uint64_t>(front) << 32) | static_cast<uint64_t>(back); }
  bool take(int64_t run, bool front, int64_t& chunk) {
    std::atomic<uint64_t>& state = state_[run];
    uint64_t seen = state.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t f = static_cast<int64_t>(seen >> 32), b = static_cast<int64_t>(seen & 0xffffffffu);
      if (f >= b) return false;
      chunk = front ? f : b - 1;
      if (state.compare_exchange_weak(seen, front ? pack(f + 1, b) : pack(f, b - 1), std::memory_order_relaxed)) return true;
    }
  }

  const int64_t n_, grain_, runs_;
  std::unique_ptr<std::atomic<uint64_t>[]> state_;
};

// Runs `per_thread(claimer)` once on each of the pool's threads (fewer when there are fewer chunks);
// each call loops on `claimer.next(begin, end)`, so per-thread scratch lives in `per_thread`.
// Inside a parallel region, or with one thread, the caller's thread does everything.
template <typename PerThread>
void parallel_claim(int64_t n, int64_t grain, ClaimOrder order, const PerThread& per_thread) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t num_chunks = (n + grain - 1) / grain;
  const int64_t threads = at::in_parallel_region() ? 1 : std::min<int64_t>(at::get_num_threads(), num_chunks);
  ClaimedChunks chunks(n, grain, threads, order);
  if (threads <= 1) {
    ClaimedChunks::Claimer claimer(chunks, 0);
    per_thread(claimer);
    return;
  }
  at::parallel_for(0, threads, 1, [&](int64_t thread, int64_t) {
    ClaimedChunks::Claimer claimer(chunks, thread);
    per_thread(claimer);
  });
}

// A grain giving each thread about `chunks_per_thread` chunks of [0, n) (at least one item each).
inline int64_t grain_for(int64_t n, int64_t chunks_per_thread) {
  return std::max<int64_t>(1, n / (std::max<int64_t>(at::get_num_threads(), 1) * chunks_per_thread));
}

}  // namespace tritonllm
