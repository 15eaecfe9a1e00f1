// The float32 greedy head's token ids through an 8-bit screen: every logit approximated with integer
// dot products and bounded, then the few tokens the bounds cannot rule out recomputed in float32.
//
// Why: a greedy row that wants no log-prob needs only the argmax of its float32 logits, and the LM head
// is the largest GEMM of a small model's decode step. The 8-bit pass reads a quarter of the float32
// head's bytes and adds more products per instruction: AVX512-VNNI's `vpdpbusd` adds 64 byte products
// where a float32 FMA adds 16; AVX-VNNI's (the same instruction on 256 bits) 32 where an AVX2 FMA adds 8;
// plain AVX2's `vpmaddubsw` + `vpmaddwd` + `vpaddd` 32 in three instructions. The bfloat16 screen
// (screened_greedy_head.cpp) gains that only where the bfloat16 dot products run at twice the FMAs' rate.
//
// The approximation, per row x and block b of 32 values along K: s_b = max|x_b| / Q and
// x^_k = round(x_k / s_b) in -Q..Q; per token j, W's block as d_jb * q_jk with q in -127..127
// (devices/cpu/greedy_screen.py packs them and their error terms at load). Then
//     a_j = sum_b s_b d_jb sum_k q_jk x^_k,        |exact_j - a_j| <= B_j = sum_b s_b c_jb,
// where c_jb (from Python, rounded up) bounds, per unit of s_b, the error of x^ (half a step times
// sum |w|), the weight's own residual (127 times sum |w - d q|, as |x^| <= Q <= 127) and the float32
// roundings of both sums. With L = max_j (a_j - B_j), a token with a_j + B_j < L is below some other
// token's exact logit, so it is neither the argmax nor tied with it; the rest are recomputed
// (screen_rescore.h).
//
// Q (`steps`) is 127 where the CPU has a VNNI dot product. Plain AVX2's `vpmaddubsw` adds two products
// u8 * s8 in saturating int16, so there x is quantized to Q = 63 (stored as x^ + 64 in 1..127), which
// keeps 2 * 127 * 127 inside int16; c is then packed for 63 steps (greedy_screen.py).
//
// Layout (padded tokens have zero codes and scales and are never candidates):
//   codes [V' / 16, K / 4, 16, 4] int8 (V' = V padded to a multiple of 32): for 16 tokens, each k quad as
//   16 int32 lanes (one zmm, or two ymm); d, c [V' / 16, K / 32, 16] float32; negq [V' / 16, K / 32, 16]
//   int32: -128 * sum_k q_jk, since x^ is stored as x^ + 128 (the dot products multiply unsigned bytes
//   of x by signed bytes of W; halved for the offset of 64).

#include <ATen/Parallel.h>

#include "cpu_tensors.h"
#include "ops.h"

#include "claimed_chunks.h"
#include "screen_rescore.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define TRITONLLM_INT8_SCREEN 512
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define TRITONLLM_INT8_SCREEN 256
#include <immintrin.h>
#else
#define TRITONLLM_INT8_SCREEN 0
#endif

namespace {

constexpr int64_t kGroup = 16;  // tokens per group: their int32 lanes are one zmm or two ymm
constexpr int64_t kBlock = 32;  // k values per scale of x and of W

#if TRITONLLM_INT8_SCREEN == 256
// AVX-VNNI (Intel since Alder Lake and Sierra Forest, AMD since Zen 5) is not part of x86-64-v3, so the
// avx2 build asks the CPU at run time and emits the instruction itself.
bool cpu_has_avx_vnni() {
  static const bool has = __builtin_cpu_supports("avxvnni");
  return has;
}
#endif

}  // namespace

namespace tritonllm {

std::string int8_screen_instructions() {
#if TRITONLLM_INT8_SCREEN == 512
  return "AVX512-VNNI";
#elif TRITONLLM_INT8_SCREEN == 256
  return cpu_has_avx_vnni() ? "AVX-VNNI" : "AVX2";
#else
  return "";
#endif
}

bool int8_screen_supported() { return TRITONLLM_INT8_SCREEN != 0; }

}  // namespace tritonllm

namespace {

#if TRITONLLM_INT8_SCREEN

// The integer dot products, one policy per instruction set: how many int32 lanes a vector has, how many
// 16-token groups a tile takes (as many as keep R rows' accumulators in registers), x's range Q, and
// acc += the sums of four u8 * s8 products per lane.
#if TRITONLLM_INT8_SCREEN == 512
struct ZmmVnni {
  static constexpr int kLanes = 16, kTileGroups = 2;
  typedef int32_t vi __attribute__((vector_size(64)));
  typedef float vf __attribute__((vector_size(64)));
  static vi load(const void* p) { return (vi)_mm512_loadu_si512(p); }
  static vi splat(int32_t x) { return (vi)_mm512_set1_epi32(x); }
  static vi dot(vi acc, vi x, vi w) { return (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)x, (__m512i)w); }
};
#else
struct YmmAvxVnni {
  static constexpr int kLanes = 8, kTileGroups = 1;
  typedef int32_t vi __attribute__((vector_size(32)));
  typedef float vf __attribute__((vector_size(32)));
  static vi load(const void* p) { return (vi)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static vi splat(int32_t x) { return (vi)_mm256_set1_epi32(x); }
  static vi dot(vi acc, vi x, vi w) {
    __m256i a = (__m256i)acc;
    asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(a) : "x"((__m256i)x), "x"((__m256i)w));  // not in -march=x86-64-v3
    return (vi)a;
  }
};
struct YmmAvx2 {  // x in 63 steps only (see the top)
  static constexpr int kLanes = 8, kTileGroups = 1;
  typedef int32_t vi __attribute__((vector_size(32)));
  typedef float vf __attribute__((vector_size(32)));
  static vi load(const void* p) { return YmmAvxVnni::load(p); }
  static vi splat(int32_t x) { return YmmAvxVnni::splat(x); }
  static vi dot(vi acc, vi x, vi w) {
    const __m256i pairs = _mm256_maddubs_epi16((__m256i)x, (__m256i)w);  // |sum| <= 2 * 127 * 127: no saturation
    return acc + (vi)_mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
  }
};
#endif

constexpr int kRows = 4;                 // rows per tile
constexpr int64_t kClaimsPerThread = 8;  // tile runs each thread claims (claimed_chunks.h)

struct Int8Head {
  const int8_t* codes;
  const float* d;
  const int32_t* negq;
  const float* c;
  int64_t k, blocks;
};

// x row -> its codes (x^ + Q + 1) and per block the scale of the approximation (s) and of the bound (sb).
// A block too small for Q / max to stay finite is left out of the approximation (x^ = 0, s = 0) and
// bounded by its size instead: |x_k| <= max = sb / 2, and c_jb >= sum |w| / 2. Returns false for a row
// with a NaN or an infinity, which has no argmax to find.
template <int Q>
bool quantize_row(const float* x, int64_t k, uint8_t* xq, float* s, float* sb) {
  constexpr int offset = Q + 1;
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    float mx = 0.f;
    for (int i = 0; i < kBlock; ++i) {
      uint32_t bits;
      std::memcpy(&bits, xb + i, sizeof bits);
      if ((bits & 0x7f800000u) == 0x7f800000u) return false;  // by its bits: -ffast-math drops isnan/isfinite
      mx = std::max(mx, std::fabs(xb[i]));
    }
    if (mx < 1e-30f) {
      s[b] = 0.f, sb[b] = 2.f * mx;
      std::fill(xq + b * kBlock, xq + (b + 1) * kBlock, static_cast<uint8_t>(offset));
      continue;
    }
    s[b] = sb[b] = mx / Q;
    const float inv = Q / mx;
    for (int i = 0; i < kBlock; ++i) {
      const float v = std::nearbyint(xb[i] * inv);  // |v| <= Q: x * inv <= Q (1 + 3u) rounds to Q at most
      xq[b * kBlock + i] = static_cast<uint8_t>(static_cast<int>(v) + offset);
    }
  }
  return true;
}

// Rows r0.. r0 + R (their codes xq [R, K], scales s, sb [R, blocks]) against the tile's token groups from g0:
// writes a_j + B_j to hi and raises floor[r] to max_j (a_j - B_j).
template <class D, int Q, int R>
void screen_tile(const uint8_t* xq, const float* s, const float* sb, const Int8Head& h, int64_t g0, float* hi,
                 int64_t ldh, float* floor) {
  using vi = typename D::vi;
  using vf = typename D::vf;
  constexpr int L = D::kLanes, PerGroup = kGroup / L, V = D::kTileGroups * PerGroup;  // vectors across the tile
  vf approx[R][V], bound[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) approx[r][v] = bound[r][v] = vf{};
  const int64_t quads = h.k / 4;
  for (int64_t b = 0; b < h.blocks; ++b) {
    vi acc[R][V];
    for (int v = 0; v < V; ++v) {
      // negq is -128 * sum q, for x^ + 128; x^ + 64 needs half of it (exact: it is even).
      const vi init = D::load(h.negq + ((g0 + v / PerGroup) * h.blocks + b) * kGroup + (v % PerGroup) * L) >> (Q == 63);
      for (int r = 0; r < R; ++r) acc[r][v] = init;
    }
#pragma GCC unroll 8
    for (int64_t i = 0; i < kBlock / 4; ++i) {
      const int64_t quad = b * (kBlock / 4) + i;
      vi w[V];
      for (int v = 0; v < V; ++v) w[v] = D::load(h.codes + ((g0 + v / PerGroup) * quads + quad) * 64 + (v % PerGroup) * L * 4);
      for (int r = 0; r < R; ++r) {
        int32_t quad_bytes;
        std::memcpy(&quad_bytes, xq + r * h.k + quad * 4, sizeof quad_bytes);
        const vi xb = D::splat(quad_bytes);
        for (int v = 0; v < V; ++v) acc[r][v] = D::dot(acc[r][v], xb, w[v]);
      }
    }
    for (int v = 0; v < V; ++v) {
      const int64_t at = ((g0 + v / PerGroup) * h.blocks + b) * kGroup + (v % PerGroup) * L;
      vf dv, cv;
      std::memcpy(&dv, h.d + at, sizeof dv);
      std::memcpy(&cv, h.c + at, sizeof cv);
      for (int r = 0; r < R; ++r) {
        approx[r][v] += __builtin_convertvector(acc[r][v], vf) * (dv * s[r * h.blocks + b]);
        bound[r][v] += sb[r * h.blocks + b] * cv;
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    vf lo = approx[r][0] - bound[r][0];
    for (int v = 0; v < V; ++v) {
      const vf up = approx[r][v] + bound[r][v], down = approx[r][v] - bound[r][v];
      std::memcpy(hi + r * ldh + g0 * kGroup + v * L, &up, sizeof up);
      lo = lo > down ? lo : down;
    }
    float m = lo[0];
    for (int l = 1; l < L; ++l) m = std::max(m, lo[l]);
    floor[r] = std::max(floor[r], m);
  }
}

template <class D, int Q>
void screen_rows(const float* xp, int64_t rows, const Int8Head& head, int64_t groups, const float* wp, int64_t vocab,
                 float* hi, int64_t* ip, int64_t* cp) {
  using Tile = void (*)(const uint8_t*, const float*, const float*, const Int8Head&, int64_t, float*, int64_t, float*);
  constexpr Tile kTiles[kRows + 1] = {nullptr, &screen_tile<D, Q, 1>, &screen_tile<D, Q, 2>, &screen_tile<D, Q, 3>,
                                      &screen_tile<D, Q, 4>};
  const int64_t k = head.k, blocks = head.blocks, ldh = groups * kGroup;
  std::vector<uint8_t> xq(rows * k);
  std::vector<float> s(rows * blocks), sb(rows * blocks);
  std::vector<char> finite(rows);
  for (int64_t r = 0; r < rows; ++r)
    finite[r] = quantize_row<Q>(xp + r * k, k, xq.data() + r * k, s.data() + r * blocks, sb.data() + r * blocks);
  std::vector<float> floor(rows, -std::numeric_limits<float>::infinity());
  std::mutex floor_lock;
  const int64_t tiles = groups / D::kTileGroups;
  tritonllm::parallel_claim(tiles, tritonllm::grain_for(tiles, kClaimsPerThread), tritonllm::ClaimOrder::kOwnRuns,
                            [&](tritonllm::ClaimedChunks::Claimer& items) {
    std::vector<float> mine(rows, -std::numeric_limits<float>::infinity());
    for (int64_t begin, end; items.next(begin, end);)
      for (int64_t t = begin; t < end; ++t)
        for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
          const int n = static_cast<int>(std::min<int64_t>(kRows, rows - r0));
          kTiles[n](xq.data() + r0 * k, s.data() + r0 * blocks, sb.data() + r0 * blocks, head, t * D::kTileGroups,
                    hi + r0 * ldh, ldh, mine.data() + r0);
        }
    std::lock_guard<std::mutex> hold(floor_lock);
    for (int64_t r = 0; r < rows; ++r) floor[r] = std::max(floor[r], mine[r]);
  });
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> cand;
    for (int64_t r = begin; r < end; ++r) {
      if (!finite[r]) continue;  // NaN or inf in x: no logit means anything; id 0, no candidates
      cand.clear();
      tritonllm::collect_candidates(hi + r * ldh, nullptr, 0.f, vocab, floor[r], cand);
      ip[r] = tritonllm::rescored_argmax(xp + r * k, k, wp, cand);
      cp[r] = static_cast<int64_t>(cand.size());
    }
  });
}

#endif

}  // namespace

namespace tritonllm {

std::tuple<at::Tensor, at::Tensor> int8_greedy_screen(const at::Tensor& x_in, const at::Tensor& codes_in,
                                                      const at::Tensor& d_in, const at::Tensor& negq_in,
                                                      const at::Tensor& c_in, const at::Tensor& weight_in,
                                                      int64_t steps) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "int8_greedy_screen: x float32 [rows, K]");
  TORCH_CHECK(weight_in.dim() == 2 && weight_in.scalar_type() == at::kFloat && weight_in.size(1) == x_in.size(1),
              "int8_greedy_screen: weight float32 [V, K] with x's K");
  const int64_t rows = x_in.size(0), k = x_in.size(1), vocab = weight_in.size(0), blocks = k / kBlock;
  const int64_t groups = codes_in.dim() == 4 ? codes_in.size(0) : -1;
  TORCH_CHECK(steps == 127 || steps == 63, "int8_greedy_screen: x in 127 or 63 steps");
  TORCH_CHECK(vocab > 0 && k > 0 && k % kBlock == 0, "int8_greedy_screen: K a multiple of 32");
  TORCH_CHECK(groups % 2 == 0 && groups * kGroup >= vocab && (groups - 2) * kGroup < vocab,
              "int8_greedy_screen: codes for V padded to a multiple of 32");
  TORCH_CHECK(codes_in.scalar_type() == at::kChar && codes_in.is_contiguous() &&
                  codes_in.sizes() == at::IntArrayRef({groups, k / 4, kGroup, 4}),
              "int8_greedy_screen: codes int8 [V' / 16, K / 4, 16, 4]");
  for (const at::Tensor* t : {&d_in, &c_in})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->sizes() == at::IntArrayRef({groups, blocks, kGroup}),
                "int8_greedy_screen: d and c float32 [V' / 16, K / 32, 16]");
  TORCH_CHECK(negq_in.scalar_type() == at::kInt && negq_in.is_contiguous() &&
                  negq_in.sizes() == at::IntArrayRef({groups, blocks, kGroup}),
              "int8_greedy_screen: negq int32 [V' / 16, K / 32, 16]");
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  at::Tensor ids = new_zeroed_tensor({rows}, x.options().dtype(at::kLong));
  at::Tensor candidates = new_zeroed_tensor({rows}, x.options().dtype(at::kLong));
#if TRITONLLM_INT8_SCREEN
  if (rows == 0) return {ids, candidates};
  const Int8Head head{codes_in.data_ptr<int8_t>(), d_in.data_ptr<float>(), negq_in.data_ptr<int32_t>(),
                      c_in.data_ptr<float>(), k, blocks};
  at::Tensor hi = new_tensor({rows, groups * kGroup}, x.options());
  const auto args = std::make_tuple(x.data_ptr<float>(), rows, head, groups, weight.data_ptr<float>(), vocab,
                                    hi.data_ptr<float>(), ids.data_ptr<int64_t>(), candidates.data_ptr<int64_t>());
#if TRITONLLM_INT8_SCREEN == 512
  std::apply(steps == 127 ? screen_rows<ZmmVnni, 127> : screen_rows<ZmmVnni, 63>, args);
#else
  TORCH_CHECK(steps == 63 || cpu_has_avx_vnni(), "int8_greedy_screen: 127 steps need AVX-VNNI (this CPU lacks it)");
  std::apply(steps == 127 ? screen_rows<YmmAvxVnni, 127> : screen_rows<YmmAvx2, 63>, args);
#endif
#else
  (void)steps;
  TORCH_CHECK(false, "int8_greedy_screen: built without AVX2 or AVX512-VNNI");
#endif
  return {ids, candidates};
}

}  // namespace tritonllm
