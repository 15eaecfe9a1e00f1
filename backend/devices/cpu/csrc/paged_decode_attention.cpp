// Paged decode attention for CPUs: one query token per row, K and V read in place from the block
// pool, so no step copies a sequence's context (the torch path gathers every block first). Every
// row of a step goes through one call: decodes and each prompt token alike, each row reading the
// keys its position sees.
//
// Layout (layers/attention.py): q [rows, heads, head_dim]; k_cache, v_cache [kv_heads, num_blocks,
// block_size, head_dim]; block_table [num_seqs, max_blocks] int32, the step's SequenceBatch table as
// is (an entry of -1 is a block the sequence gave back: pruned by kv_window or behind a sliding
// window; it is skipped, never read). Per query row (devices/cpu/attention_rows.py): row_seq, whose
// table it reads; it sees the keys at positions row_start <= p < row_end (its position + 1; the
// start is 0, or for a sliding layer its position + 1 - window, clamped at 0). q and the result are
// float32; the pool is float32, float16 or bfloat16 (`kv_cache_dtype`): 16-bit rows are widened to
// float32 as they are loaded (F16C / a shift), so the arithmetic is the same and only half the
// bytes come from memory.
//
// One work item is (row, KV head): its query heads share every K/V row it reads, and are scored
// together (up to 4 at a time), so each row is loaded and widened once for all of them.
// The threads claim items one at a time (claimed_chunks.h), longest context first (decodes arrive
// sorted by length, shortest first, and a chunk's tokens in position order: the rows taken from the
// last one back are already in that order, and any other order is sorted), so the last items claimed
// are the cheapest and the threads finish together even when one of them was paused.
// Only the blocks a row sees are visited: those overlapping [row_start, row_end) whose entry is not
// -1. A block wholly inside that range is scored whole; the first and last may be partial (a window
// starting mid-block, the context's last block), and their keys outside the range are masked.
// K and V are read in one pass, block by block (online softmax): score the block's keys, update each
// query head's running max, sum and output (rescaled only when the max grows), add the block's V
// rows. The next block's lines are prefetched: blocks are scattered 4 KB pages the hardware cannot
// guess.
//
// The arithmetic is vectorised across keys with GCC vector extensions (VL floats: one AVX-512 or
// AVX2 register): each key's q.k is accumulated as VL partial sums, then VL keys' partials are
// folded into one vector of VL scores by pairwise shuffles (log2(VL) levels), so no key pays for a
// horizontal sum of its own (on AVX-512 the fold takes in-lane shuffles first, 128-bit block
// shuffles last, and no two-source permutes); softmax weights use a vector exp; the query heads that
// share a KV head are scored together, so each key is loaded once for all of them. Shapes
// the vector path does not cover (head_dim or block_size not a multiple of VL) take a scalar path
// with the same results.
// Built with -ffast-math: nothing here produces an infinity or a NaN (masked keys of a partial block
// get a finite -1e30 score and are never read from V), which that flag requires.

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <ATen/Parallel.h>

#include "cpu_tensors.h"
#include "ops.h"

#include "claimed_chunks.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
#define TRITONLLM_VL 16
#else
#define TRITONLLM_VL 8
#endif
constexpr int VL = TRITONLLM_VL;
typedef float vf __attribute__((vector_size(TRITONLLM_VL * 4)));
typedef int vi __attribute__((vector_size(TRITONLLM_VL * 4)));
constexpr float kMasked = -1e30f;

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// VL consecutive K or V elements of the pool as float32.
inline vf load_row(const float* p) { return load(p); }

template <typename T>
inline vf widen_each(const T* p) {  // any CPU: one element at a time
  vf v;
  for (int i = 0; i < VL; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}

template <typename W>
inline vf as_vf(W w) {
  static_assert(sizeof(W) == sizeof(vf), "one register of VL floats");
  vf v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

#if TRITONLLM_VL == 16
inline vf load_row(const c10::Half* p) { return as_vf(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p))); }
inline vf load_row(const c10::BFloat16* p) {  // bfloat16 is the top half of a float32
  return as_vf(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
#elif defined(__AVX2__) && defined(__F16C__)
inline vf load_row(const c10::Half* p) { return as_vf(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p))); }
inline vf load_row(const c10::BFloat16* p) {
  return as_vf(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
#else
inline vf load_row(const c10::Half* p) { return widen_each(p); }
inline vf load_row(const c10::BFloat16* p) { return widen_each(p); }
#endif

// Lanes (0,1), (2,3), ... of a, then of b, each pair summed: [a0+a1, a2+a3, ..., b0+b1, ...].
#if TRITONLLM_VL == 16
#define TRITONLLM_EVEN 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define TRITONLLM_ODD 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
#else
#define TRITONLLM_EVEN 0, 2, 4, 6, 8, 10, 12, 14
#define TRITONLLM_ODD 1, 3, 5, 7, 9, 11, 13, 15
#endif
inline vf pair_sums(vf a, vf b) {
#if defined(__clang__)
  return __builtin_shufflevector(a, b, TRITONLLM_EVEN) + __builtin_shufflevector(a, b, TRITONLLM_ODD);
#else
  return __builtin_shuffle(a, b, vi{TRITONLLM_EVEN}) + __builtin_shuffle(a, b, vi{TRITONLLM_ODD});
#endif
}

// p[t] holds VL partial sums of key t; returns lane t = key t's total.
#if TRITONLLM_VL == 16
// AVX-512: in-lane shuffles first (unpack, then shufps), 128-bit block shuffles last; the lanes
// come out in key order, with no two-source permutes (or their index registers).
inline vf fold_keys(vf* p) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {  // per 128-bit block: [key 2i, key 2i+1, key 2i, key 2i+1]
    const __m512 x = (__m512)p[2 * i], y = (__m512)p[2 * i + 1];
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit block: keys 4i .. 4i+3
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 2; ++i) {  // blocks: keys 8i..8i+3 twice, then 8i+4..8i+7 twice
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  }
  return (vf)_mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}
#else
// Each level halves the vectors and keeps every lane pair inside one key, so after log2(VL)
// levels lane t is key t.
inline vf fold_keys(vf* p) {
  for (int n = VL; n > 1; n /= 2) {
    for (int i = 0; i < n / 2; ++i) p[i] = pair_sums(p[2 * i], p[2 * i + 1]);
  }
  return p[0];
}
#endif

// e^x for x <= 0 (softmax weights: score minus the running max). Cody-Waite range reduction and
// the Cephes expf polynomial: about 1 ulp, as the scalar expf.
inline vf exp_nonpositive(vf x) {
  x = x < -87.f ? vf{} - 87.f : x;
  const vi n = __builtin_convertvector(x * 1.44269504f - 0.5f, vi);  // truncation = round(x / ln 2) for x <= 0
  const vf nf = __builtin_convertvector(n, vf);
  const vf r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  vf p = vf{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const vi bits = (n + 127) << 23;
  vf two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// Prefetches the next block's K and V, a few cache lines of each per call. The vector path calls it
// once per key and query head it scores or adds, so the lines are requested evenly through the
// block's arithmetic:
// a burst of prefetches up front would fill the core's miss buffers and stall that arithmetic.
struct NextBlock {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t bytes = 0, pos = 0, per_call = 1;
  inline void step() {
    for (int64_t i = 0; i < per_call && pos < bytes; ++i, pos += 64) {
      __builtin_prefetch(k + pos, 0, 2);  // into L2
      __builtin_prefetch(v + pos, 0, 2);
    }
  }
  void all() {  // the scalar path: everything at once
    per_call = bytes;
    step();
  }
};

struct Shapes {
  int64_t B, H, D, KVH, NB, BS, S, MAXB, G;  // B: query rows; S: sequences (block-table rows)
};

// Running softmax state of one query head: max, sum and the unnormalised output row (D floats).
struct HeadState {
  float max = -FLT_MAX, sum = 0.f;
};

// A block whose max `bmax` raises the head's running max: rescale its sum and output row to it.
inline void rescale(HeadState& st, float bmax, float* o, int64_t D) {
  if (bmax <= st.max) return;
  const float corr = st.max == -FLT_MAX ? 0.f : std::exp(st.max - bmax);
  st.sum *= corr;
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) o[d] *= corr;
  st.max = bmax;
}

// One block for query heads [0, GC) of a KV head, vector path. DV = head_dim / VL and GC are
// compile-time constants, so the heads' query rows and output accumulators stay in registers: each
// K and V row is loaded (and, for a 16-bit pool, widened) once for all GC heads instead of once per
// head. Each head's arithmetic is the same sequence of operations as scoring it alone.
template <typename T, int DV, int GC>
void block_vec(const float* qh, const T* kb, const T* vb, const bool* mb, bool full, const Shapes& s,
               float scale, HeadState* st, float* oh, float* scores, NextBlock& next) {
  constexpr int64_t D = DV * VL;
  float* sc[GC];
  for (int g = 0; g < GC; ++g) sc[g] = scores + g * s.BS;
  {
    vf qv[GC][DV];
    for (int g = 0; g < GC; ++g)
      for (int c = 0; c < DV; ++c) qv[g][c] = load(qh + g * D + c * VL);
    for (int64_t t0 = 0; t0 < s.BS; t0 += VL) {
      vf part[GC][VL];
      for (int t = 0; t < VL; ++t) {
        const T* kr = kb + (t0 + t) * D;
        next.step();
        vf k[DV];
        for (int c = 0; c < DV; ++c) k[c] = load_row(kr + c * VL);
        for (int g = 0; g < GC; ++g) {
          vf acc = qv[g][0] * k[0];
          for (int c = 1; c < DV; ++c) acc += qv[g][c] * k[c];
          part[g][t] = acc;
        }
      }
      for (int g = 0; g < GC; ++g) store(sc[g] + t0, fold_keys(part[g]) * scale);
    }
  }
  for (int g = 0; g < GC; ++g) {
    float* scg = sc[g];
    if (!full) {
      for (int64_t t = 0; t < s.BS; ++t) scg[t] = mb[t] ? scg[t] : kMasked;
    }
    float bmax = scg[0];
    for (int64_t t = 1; t < s.BS; ++t) bmax = std::max(bmax, scg[t]);
    rescale(st[g], bmax, oh + g * D, D);
    for (int64_t t0 = 0; t0 < s.BS; t0 += VL) store(scg + t0, exp_nonpositive(load(scg + t0) - st[g].max));
    if (!full) {
      for (int64_t t = 0; t < s.BS; ++t) scg[t] = mb[t] ? scg[t] : 0.f;  // masked: no weight
    }
  }
  vf acc[GC][DV];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < DV; ++c) acc[g][c] = load(oh + g * D + c * VL);
  for (int64_t t = 0; t < s.BS; ++t) {
    if (!full && !mb[t]) continue;  // its V row (maybe never written) is not read
    next.step();
    vf v[DV];
    const T* vr = vb + t * D;
    for (int c = 0; c < DV; ++c) v[c] = load_row(vr + c * VL);
    for (int g = 0; g < GC; ++g) {
      const vf w = vf{} + sc[g][t];
      for (int c = 0; c < DV; ++c) acc[g][c] += w * v[c];
    }
  }
  for (int g = 0; g < GC; ++g) {
    for (int c = 0; c < DV; ++c) store(oh + g * D + c * VL, acc[g][c]);
    float total = 0.f;
    for (int64_t t = 0; t < s.BS; ++t) total += sc[g][t];  // masked weights were zeroed above
    st[g].sum += total;
  }
}

// All G query heads of a KV head in groups of GC (a divisor of G).
template <typename T, int DV, int GC>
void block_vec_groups(const float* qh, const T* kb, const T* vb, const bool* mb, bool full, const Shapes& s,
                      float scale, HeadState* st, float* oh, float* scores, NextBlock& next) {
  constexpr int64_t D = DV * VL;
  for (int64_t g0 = 0; g0 < s.G; g0 += GC) {
    block_vec<T, DV, GC>(qh + g0 * D, kb, vb, mb, full, s, scale, st + g0, oh + g0 * D, scores, next);
  }
}

// One block for all G query heads, scalar path (any head_dim and block size).
template <typename T>
void block_scalar(const float* qh, const T* kb, const T* vb, const bool* mb, bool full, const Shapes& s,
                  float scale, HeadState* st, float* oh, float* scores, NextBlock& next) {
  next.all();
  const int64_t D = s.D;
  for (int64_t g = 0; g < s.G; ++g) {
    const float* qr = qh + g * D;
    float bmax = -FLT_MAX;
    for (int64_t t = 0; t < s.BS; ++t) {
      if (!full && !mb[t]) continue;
      const T* kr = kb + t * D;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t d = 0; d < D; ++d) acc += qr[d] * static_cast<float>(kr[d]);
      scores[t] = acc * scale;
      bmax = std::max(bmax, scores[t]);
    }
    float* o = oh + g * D;
    rescale(st[g], bmax, o, D);
    for (int64_t t = 0; t < s.BS; ++t) {
      if (!full && !mb[t]) continue;
      const float w = std::exp(scores[t] - st[g].max);
      st[g].sum += w;
      const T* vr = vb + t * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] += w * static_cast<float>(vr[d]);
    }
  }
}

template <typename T>
using BlockFn = void (*)(const float*, const T*, const T*, const bool*, bool, const Shapes&, float, HeadState*,
                         float*, float*, NextBlock&);

// The largest head group of at most 4 that divides G: 4 heads x DV accumulators still fit in
// registers at head_dim 64.
inline int head_group(int64_t G) {
  for (int gc = 4; gc > 1; --gc) {
    if (G % gc == 0) return gc;
  }
  return 1;
}

template <typename T, int DV>
BlockFn<T> block_fn_dv(int64_t G) {
  switch (head_group(G)) {
    case 4: return &block_vec_groups<T, DV, 4>;
    case 3: return &block_vec_groups<T, DV, 3>;
    case 2: return &block_vec_groups<T, DV, 2>;
    default: return &block_vec_groups<T, DV, 1>;
  }
}

template <typename T>
BlockFn<T> block_fn(const Shapes& s) {
  if (s.BS % VL != 0) return &block_scalar<T>;
  switch (s.D) {
    case 2 * VL: return block_fn_dv<T, 2>(s.G);
    case 4 * VL: return block_fn_dv<T, 4>(s.G);
    case 8 * VL: return block_fn_dv<T, 8>(s.G);
    case 16 * VL: return block_fn_dv<T, 16>(s.G);
    default: return &block_scalar<T>;
  }
}

// The rows in the order their items are claimed: the most keys first. Decodes arrive shortest first and
// a chunk's tokens in position order, so the rows from the last one back are usually that order already.
inline std::vector<int64_t> longest_first(const int32_t* row_end, const int32_t* row_start, int64_t rows) {
  std::vector<int64_t> order(rows);
  for (int64_t i = 0; i < rows; ++i) order[i] = rows - 1 - i;
  const auto more_keys = [&](int64_t a, int64_t b) {
    return std::max(row_end[a] - row_start[a], 0) > std::max(row_end[b] - row_start[b], 0);
  };
  if (!std::is_sorted(order.begin(), order.end(), more_keys)) std::stable_sort(order.begin(), order.end(), more_keys);
  return order;
}

template <typename T>
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
            const at::Tensor& row_seq, const at::Tensor& row_end, const at::Tensor& row_start, const Shapes& s,
            float fscale, at::Tensor& out) {
  const float* qp = q.data_ptr<float>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tp = block_table.data_ptr<int32_t>();
  const int32_t* seqp = row_seq.data_ptr<int32_t>();
  const int32_t* endp = row_end.data_ptr<int32_t>();
  const int32_t* startp = row_start.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const BlockFn<T> attend_block = block_fn<T>(s);
  const int64_t block_elems = s.BS * s.D;
  // NextBlock::step calls in block_vec per block: a K row and a V row for each key, per head group.
  const int64_t calls_per_block = 2 * (s.G / head_group(s.G)) * s.BS;
  const std::vector<int64_t> order = longest_first(endp, startp, s.B);

  tritonllm::parallel_claim(s.B * s.KVH, 1, tritonllm::ClaimOrder::kInOrder, [&](tritonllm::ClaimedChunks::Claimer& items) {
    std::vector<float> scores(s.G * s.BS);  // one row of block scores per query head
    std::vector<HeadState> st(s.G);
    std::unique_ptr<bool[]> partial(new bool[s.BS]);  // which keys of a partial block the row sees
    for (int64_t begin, end; items.next(begin, end);) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t h = item % s.KVH, b = order[item / s.KVH];
        const float* qh = qp + (b * s.H + h * s.G) * s.D;
        const int32_t* table = tp + static_cast<int64_t>(seqp[b]) * s.MAXB;
        const int64_t first = startp[b], last = endp[b];  // keys first <= p < last
        float* oh = op + (b * s.H + h * s.G) * s.D;
        std::fill(oh, oh + s.G * s.D, 0.f);
        std::fill(st.begin(), st.end(), HeadState{});
        const int64_t j_end = (last + s.BS - 1) / s.BS;
        int64_t j = first < last ? first / s.BS : j_end;
        while (j < j_end && table[j] < 0) ++j;  // blocks given back
        while (j < j_end) {
          int64_t j_next = j + 1;
          while (j_next < j_end && table[j_next] < 0) ++j_next;
          NextBlock next;
          if (j_next < j_end) {
            next.k = reinterpret_cast<const char*>(kp + (h * s.NB + table[j_next]) * block_elems);
            next.v = reinterpret_cast<const char*>(vp + (h * s.NB + table[j_next]) * block_elems);
            next.bytes = block_elems * static_cast<int64_t>(sizeof(T));
            next.per_call = (next.bytes / 64 + calls_per_block - 1) / calls_per_block;
          }
          // The block's keys the row sees: [lo, hi) of its BS.
          const int64_t lo = std::max<int64_t>(first - j * s.BS, 0), hi = std::min<int64_t>(last - j * s.BS, s.BS);
          const bool full = lo == 0 && hi == s.BS;
          if (!full) {
            for (int64_t t = 0; t < s.BS; ++t) partial[t] = t >= lo && t < hi;
          }
          const T* kb = kp + (h * s.NB + table[j]) * block_elems;
          const T* vb = vp + (h * s.NB + table[j]) * block_elems;
          attend_block(qh, kb, vb, partial.get(), full, s, fscale, st.data(), oh, scores.data(), next);
          j = j_next;
        }
        for (int64_t g = 0; g < s.G; ++g) {
          const float inv = st[g].sum > 0.f ? 1.f / st[g].sum : 0.f;
          float* o = oh + g * s.D;
#pragma omp simd
          for (int64_t d = 0; d < s.D; ++d) o[d] *= inv;
        }
      }
    }
  });
}

}  // namespace

namespace tritonllm {

at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_table_in, const at::Tensor& row_seq_in,
                                  const at::Tensor& row_end_in, const at::Tensor& row_start_in, double scale) {
  TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode_attention: q [B,H,D], k/v cache [KVH,NB,BS,D]");
  const at::ScalarType kv = k_cache.scalar_type();
  TORCH_CHECK(q_in.scalar_type() == at::kFloat, "paged_decode_attention: float32 queries only");
  TORCH_CHECK(v_cache.scalar_type() == kv && (kv == at::kFloat || kv == at::kHalf || kv == at::kBFloat16),
              "paged_decode_attention: a float32, float16 or bfloat16 pool");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode_attention: contiguous pool");
  const at::Tensor q = q_in.contiguous();
  // int32 as SequenceBatch holds them (a no-op then).
  const at::Tensor table = block_table_in.to(at::kInt).contiguous();
  const at::Tensor row_seq = row_seq_in.to(at::kInt).contiguous();
  const at::Tensor row_end = row_end_in.to(at::kInt).contiguous();
  const at::Tensor row_start = row_start_in.to(at::kInt).contiguous();
  Shapes s;
  s.B = q.size(0), s.H = q.size(1), s.D = q.size(2);
  s.KVH = k_cache.size(0), s.NB = k_cache.size(1), s.BS = k_cache.size(2);
  TORCH_CHECK(table.dim() == 2, "paged_decode_attention: block_table [num_seqs, max_blocks]");
  s.S = table.size(0), s.MAXB = table.size(1);
  TORCH_CHECK(k_cache.size(3) == s.D && s.H % s.KVH == 0, "paged_decode_attention: head shapes");
  TORCH_CHECK(row_seq.numel() == s.B && row_end.numel() == s.B && row_start.numel() == s.B,
              "paged_decode_attention: row_seq, row_end and row_start: one per query row");
  s.G = s.H / s.KVH;  // query heads per KV head
  at::Tensor out = new_tensor(q.sizes(), q.options());
  const int32_t* tp = table.data_ptr<int32_t>();
  for (int64_t i = 0; i < s.S * s.MAXB; ++i) {
    TORCH_CHECK(tp[i] >= -1 && tp[i] < s.NB, "paged_decode_attention: block id out of range");
  }
  const int32_t* seqp = row_seq.data_ptr<int32_t>();
  const int32_t* endp = row_end.data_ptr<int32_t>();
  const int32_t* startp = row_start.data_ptr<int32_t>();
  for (int64_t r = 0; r < s.B; ++r) {
    TORCH_CHECK(seqp[r] >= 0 && seqp[r] < s.S, "paged_decode_attention: row_seq out of range");
    TORCH_CHECK(startp[r] >= 0 && endp[r] <= s.MAXB * s.BS, "paged_decode_attention: row keys outside the table");
  }
  const float fscale = static_cast<float>(scale);
  if (kv == at::kHalf) {
    attend<c10::Half>(q, k_cache, v_cache, table, row_seq, row_end, row_start, s, fscale, out);
  } else if (kv == at::kBFloat16) {
    attend<c10::BFloat16>(q, k_cache, v_cache, table, row_seq, row_end, row_start, s, fscale, out);
  } else {
    attend<float>(q, k_cache, v_cache, table, row_seq, row_end, row_start, s, fscale, out);
  }
  return out;
}

}  // namespace tritonllm
