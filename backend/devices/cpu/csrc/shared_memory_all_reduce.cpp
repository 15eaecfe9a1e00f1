// Tensor parallelism's all-reduce between the ranks' processes on one machine, through a shared-memory
// segment that every rank has mapped (devices/cpu/shared_memory_all_reduce.py owns it). gloo's all-reduce
// goes through loopback TCP and its threads; for the small tensors of a decode step (a few hundred KB at
// most) the cost is the synchronisation, which here is one cache line per rank.
//
// The segment: a header (magic, world size, slot size, the abort word, and per rank its pid and the
// sequence number it last published, each rank's on a cache line of its own), then two buffers of one
// slot per rank. To reduce a piece (a tensor larger than a slot goes piece by piece), a rank
//   1. takes its next sequence number s and the buffer s % 2,
//   2. copies its piece into its own slot of that buffer,
//   3. publishes s (a release store: the slot's bytes are visible to whoever sees s),
//   4. waits until every rank has published at least s (acquire loads),
//   5. sums every rank's slot of that buffer, in rank order 0..N-1, into its tensor.
// Every rank sums the same slots in the same order with the same code, so all get the same bits; a
// bfloat16 or float16 sum is accumulated in float32 and rounded once.
//
// Why two buffers and no second barrier: a rank writes buffer s % 2 again only for piece s + 2, after it
// has waited in piece s + 1 for every rank to publish s + 1; a rank publishes s + 1 only after it finished
// reading piece s (step 5 comes before its next step 1). So when anyone overwrites a slot of piece s,
// every rank is done reading it. A rank that is ahead publishes s + 1 while a slower one still reads
// piece s: that is the other buffer.
//
// No rank may wait forever: while waiting, a rank checks the abort word, which rank 0 sets when its
// watchdog sees a worker die or when it closes, and (every kCheckPeriod) whether each rank it waits on is
// still alive; either fails the call with a c10::Error (a RuntimeError in Python) naming the rank, as
// does waiting longer than the caller's timeout. After such a failure the segment is not used again.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "ops.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include <sched.h>
#include <signal.h>
#include <sys/types.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

constexpr uint64_t kMagic = 0x31726c6c4d4c4c54ULL;  // "TLLMllr1"
constexpr int64_t kMaxRanks = 64;
// 128 bytes: a cache line and the one the adjacent-line prefetcher pairs with it, so that one rank's
// sequence number never shares a fetched pair with another's.
constexpr size_t kLine = 128;
constexpr size_t kPage = 4096;

struct alignas(kLine) RankState {
  uint64_t seq;  // the last piece this rank published (0: none yet); written by this rank only
  int64_t pid;   // 0 until the rank has mapped the segment
};

struct Header {
  uint64_t magic;
  int64_t world_size;
  int64_t slot_bytes;
  alignas(kLine) uint32_t abort;  // nonzero: every waiting rank fails at once
  RankState ranks[kMaxRanks];
};

constexpr size_t data_offset() { return (sizeof(Header) + kPage - 1) / kPage * kPage; }

uint64_t load_acquire(const uint64_t& v) { return __atomic_load_n(&v, __ATOMIC_ACQUIRE); }

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#else
  std::atomic_signal_fence(std::memory_order_seq_cst);
#endif
}

// The checked header of a segment tensor (uint8, contiguous, as large as its header says).
Header* header_of(const at::Tensor& segment) {
  TORCH_CHECK(segment.device().is_cpu() && segment.scalar_type() == at::kByte && segment.is_contiguous() &&
                  segment.dim() == 1,
              "shared-memory all-reduce: the segment is a contiguous uint8 CPU tensor");
  TORCH_CHECK(static_cast<size_t>(segment.numel()) >= data_offset(), "shared-memory all-reduce: segment too small");
  auto* h = reinterpret_cast<Header*>(segment.data_ptr());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(h) % kLine == 0, "shared-memory all-reduce: segment not aligned");
  return h;
}

Header* checked_header(const at::Tensor& segment) {
  Header* h = header_of(segment);
  TORCH_CHECK(h->magic == kMagic, "shared-memory all-reduce: the segment was not set up by rank 0");
  TORCH_CHECK(segment.numel() >= tritonllm::shm_all_reduce_segment_bytes(h->world_size, h->slot_bytes),
              "shared-memory all-reduce: segment smaller than its header says");
  return h;
}

char* slot(Header* h, uint64_t seq, int64_t rank) {
  const int64_t buffer = static_cast<int64_t>(seq & 1);
  return reinterpret_cast<char*>(h) + data_offset() + (buffer * h->world_size + rank) * h->slot_bytes;
}

// Whether process `pid` is still running: it exists (kill's signal 0: ESRCH once it is gone) and, on
// Linux, is not a zombie waiting for its parent to collect it (a dead worker stays one until rank 0's
// watchdog does; a dead rank 0 until its own parent does).
bool process_alive(int64_t pid) {
  if (pid <= 0) return true;  // not joined yet: rank 0 waits for every rank to join before any step
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
#if defined(__linux__)
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  if (FILE* f = std::fopen(path, "r")) {
    char buf[512];
    const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
    std::fclose(f);
    buf[n] = '\0';
    // "pid (comm) S ...": the state follows the last ')' (comm may itself hold parentheses).
    if (const char* close = std::strrchr(buf, ')'); close && close[1] == ' ') {
      const char state = close[2];
      if (state == 'Z' || state == 'X') return false;
    }
  }
#endif
  return true;
}

using Clock = std::chrono::steady_clock;
// The first moments of a wait spin on the sequence numbers (the other ranks are usually a few
// microseconds away), then the waiter yields its core between looks (ranks often share cores with
// each other and with the engine's threads), and after kYieldFor it sleeps between looks, so that a
// rank waiting on a long computation (a large prompt's imbalanced attention) leaves its core alone.
constexpr int kSpins = 2000;
constexpr auto kYieldFor = std::chrono::milliseconds(2);
constexpr auto kCheckPeriod = std::chrono::milliseconds(50);  // the ranks' pids and the timeout
constexpr long kSleepNs = 20000;

// Until every rank has published `seq`; throws if the abort word is set, a rank it waits on is gone, or
// `timeout_s` passes.
void wait_for_ranks(Header* h, int64_t rank, uint64_t seq, double timeout_s) {
  const int64_t world = h->world_size;
  int64_t next = 0;  // ranks below it have published seq
  auto all_published = [&] {
    for (; next < world; ++next)
      if (load_acquire(h->ranks[next].seq) < seq) return false;
    return true;
  };
  for (int i = 0; i < kSpins; ++i) {
    if (all_published()) return;
    cpu_relax();
  }
  const auto start = Clock::now();
  auto last_check = start;
  const auto timeout = std::chrono::duration<double>(timeout_s);
  for (;;) {
    if (all_published()) return;
    // Every look: a line that stays in this core's cache until rank 0 writes it.
    TORCH_CHECK(__atomic_load_n(&h->abort, __ATOMIC_ACQUIRE) == 0, "shared-memory all-reduce (rank ", rank,
                "): aborted by rank 0 (a tensor-parallel rank died, or the engine is closing)");
    const auto now = Clock::now();
    if (now - last_check >= kCheckPeriod) {
      last_check = now;
      for (int64_t r = next; r < world; ++r) {
        if (load_acquire(h->ranks[r].seq) >= seq) continue;
        const int64_t pid = __atomic_load_n(&h->ranks[r].pid, __ATOMIC_ACQUIRE);
        TORCH_CHECK(process_alive(pid), "shared-memory all-reduce (rank ", rank, "): tensor-parallel rank ", r,
                    " (pid ", pid, ") is gone");
      }
      TORCH_CHECK(now - start < timeout, "shared-memory all-reduce (rank ", rank, "): tensor-parallel rank ", next,
                  " (pid ", __atomic_load_n(&h->ranks[next].pid, __ATOMIC_ACQUIRE), ") did not arrive in ", timeout_s, " s");
    }
    if (now - start < kYieldFor) {
      sched_yield();
    } else {
      timespec pause{0, kSleepNs};
      nanosleep(&pause, nullptr);
    }
  }
}

// out[0, n) = the sum over ranks 0..N-1, in that order, of their slots of piece `seq`, in float32.
template <typename T>
void sum_slots(Header* h, uint64_t seq, T* out, int64_t n) {
  const int64_t world = h->world_size;
  constexpr int64_t kBlock = 1024;  // float32 sums kept in L1 while every rank's block is added in
  at::parallel_for(0, (n + kBlock - 1) / kBlock, 64, [&](int64_t first, int64_t last) {
    float acc[kBlock];
    for (int64_t b = first; b < last; ++b) {
      const int64_t begin = b * kBlock, len = std::min(kBlock, n - begin);
      const T* s0 = reinterpret_cast<const T*>(slot(h, seq, 0)) + begin;
      for (int64_t i = 0; i < len; ++i) acc[i] = static_cast<float>(s0[i]);
      // One pass per rank, each stored before the next: the compiler cannot regroup the ranks' sum
      // (-ffast-math allows reassociation within an expression), so its order is rank order.
      for (int64_t r = 1; r < world; ++r) {
        const T* s = reinterpret_cast<const T*>(slot(h, seq, r)) + begin;
        for (int64_t i = 0; i < len; ++i) acc[i] += static_cast<float>(s[i]);
      }
      for (int64_t i = 0; i < len; ++i) out[begin + i] = static_cast<T>(acc[i]);
    }
  });
}

template <typename T>
void reduce(Header* h, int64_t rank, T* data, int64_t numel, double timeout_s) {
  const int64_t per_piece = h->slot_bytes / static_cast<int64_t>(sizeof(T));
  for (int64_t begin = 0; begin < numel; begin += per_piece) {
    const int64_t n = std::min(per_piece, numel - begin);
    uint64_t& mine = h->ranks[rank].seq;
    const uint64_t seq = __atomic_load_n(&mine, __ATOMIC_RELAXED) + 1;  // only this rank writes it
    std::memcpy(slot(h, seq, rank), data + begin, n * sizeof(T));
    __atomic_store_n(&mine, seq, __ATOMIC_RELEASE);
    wait_for_ranks(h, rank, seq, timeout_s);
    sum_slots(h, seq, data + begin, n);
  }
}

}  // namespace

namespace tritonllm {

int64_t shm_all_reduce_segment_bytes(int64_t world_size, int64_t slot_bytes) {
  TORCH_CHECK(world_size >= 1 && world_size <= kMaxRanks, "shared-memory all-reduce: 1 to ", kMaxRanks, " ranks");
  TORCH_CHECK(slot_bytes > 0 && slot_bytes % static_cast<int64_t>(kLine) == 0,
              "shared-memory all-reduce: the slot size is a positive multiple of ", kLine, " bytes");
  return static_cast<int64_t>(data_offset()) + 2 * world_size * slot_bytes;
}

void shm_all_reduce_init(const at::Tensor& segment, int64_t world_size, int64_t slot_bytes) {
  Header* h = header_of(segment);
  TORCH_CHECK(segment.numel() >= shm_all_reduce_segment_bytes(world_size, slot_bytes),
              "shared-memory all-reduce: segment too small for ", world_size, " slots of ", slot_bytes, " bytes");
  std::memset(static_cast<void*>(h), 0, sizeof(Header));
  h->world_size = world_size;
  h->slot_bytes = slot_bytes;
  __atomic_store_n(&h->magic, kMagic, __ATOMIC_RELEASE);
}

int64_t shm_all_reduce_join(const at::Tensor& segment, int64_t rank, int64_t pid) {
  Header* h = checked_header(segment);
  TORCH_CHECK(rank >= 0 && rank < h->world_size, "shared-memory all-reduce: rank ", rank, " of ", h->world_size);
  __atomic_store_n(&h->ranks[rank].pid, pid, __ATOMIC_RELEASE);
  return h->world_size;
}

int64_t shm_all_reduce_joined(const at::Tensor& segment) {
  Header* h = checked_header(segment);
  int64_t joined = 0;
  for (int64_t r = 0; r < h->world_size; ++r) joined += __atomic_load_n(&h->ranks[r].pid, __ATOMIC_ACQUIRE) != 0;
  return joined;
}

void shm_all_reduce_abort(const at::Tensor& segment) {
  __atomic_store_n(&checked_header(segment)->abort, 1u, __ATOMIC_RELEASE);
}

at::Tensor& shm_all_reduce_(at::Tensor& x, const at::Tensor& segment, int64_t rank, double timeout_s) {
  Header* h = checked_header(segment);
  TORCH_CHECK(rank >= 0 && rank < h->world_size, "shared-memory all-reduce: rank ", rank, " of ", h->world_size);
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "shared-memory all-reduce: a contiguous CPU tensor");
  const int64_t n = x.numel();
  switch (x.scalar_type()) {
    case at::kFloat: reduce(h, rank, x.data_ptr<float>(), n, timeout_s); break;
    case at::kBFloat16: reduce(h, rank, x.data_ptr<c10::BFloat16>(), n, timeout_s); break;
    case at::kHalf: reduce(h, rank, x.data_ptr<c10::Half>(), n, timeout_s); break;
    default: TORCH_CHECK(false, "shared-memory all-reduce: float32, bfloat16 or float16, not ", x.scalar_type());
  }
  return x;
}

}  // namespace tritonllm
