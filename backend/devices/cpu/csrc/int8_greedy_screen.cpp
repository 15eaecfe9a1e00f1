// The float32 greedy head's token ids through an 8-bit screen: every logit approximated with integer
// dot products and bounded, then the few tokens the bounds cannot rule out recomputed in float32.
//
// Why: a greedy row that wants no log-prob needs only the argmax of its float32 logits, and the LM head
// is the largest GEMM of a small model's decode step. AVX512-VNNI's `vpdpbusd` adds 64 byte products
// per instruction where a float32 FMA adds 16, so on the CPUs that have it (Intel since Cascade Lake,
// AMD since Zen 4) the 8-bit pass costs about half the float32 head; the bfloat16 screen
// (screened_greedy_head.cpp) gains that only where the bfloat16 dot products run at twice the FMAs' rate.
//
// The approximation, per row x and block b of 32 values along K: s_b = max|x_b| / 127 and
// x^_k = round(x_k / s_b) in -127..127; per token j, W's block as d_jb * q_jk with q in -127..127
// (devices/cpu/greedy_screen.py packs them and their error terms at load). Then
//     a_j = sum_b s_b d_jb sum_k q_jk x^_k,        |exact_j - a_j| <= B_j = sum_b s_b c_jb,
// where c_jb (from Python, rounded up) bounds, per unit of s_b, the error of x^ (half a step times
// sum |w|), the weight's own residual (127 times sum |w - d q|) and the float32 roundings of both sums.
// With L = max_j (a_j - B_j), a token with a_j + B_j < L is below some other token's exact logit, so it
// is neither the argmax nor tied with it; the rest are recomputed (screen_rescore.h).
//
// Layout (padded tokens have zero codes and scales and are never candidates):
//   codes [V' / 16, K / 4, 16, 4] int8 (V' = V padded to a multiple of 32): for 16 tokens, each k quad as one zmm of 16 int32 lanes;
//   d, c [V' / 16, K / 32, 16] float32; negq [V' / 16, K / 32, 16] int32: -128 * sum_k q_jk, since x^ is
//   stored as x^ + 128 (vpdpbusd multiplies unsigned bytes of x by signed bytes of W).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "claimed_chunks.h"
#include "screen_rescore.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <tuple>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGroup = 16;  // tokens per zmm of int32 lanes
constexpr int64_t kBlock = 32;  // k values per scale of x and of W

bool int8_screen_supported() {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)

constexpr int kRows = 4;                 // rows per tile
constexpr int kGroups = 2;               // token groups per tile (32 tokens)
constexpr int64_t kClaimsPerThread = 8;  // tile runs each thread claims (claimed_chunks.h)

struct Int8Head {
  const int8_t* codes;
  const float* d;
  const int32_t* negq;
  const float* c;
  int64_t k, blocks;
};

// x row -> its codes (x^ + 128) and per block the scale of the approximation (s) and of the bound (sb).
// A block too small for 127 / max to stay finite is left out of the approximation (x^ = 0, s = 0) and
// bounded by its size instead: |x_k| <= max = sb / 2, and c_jb >= sum |w| / 2. Returns false for a row
// with a NaN or an infinity, which has no argmax to find.
bool quantize_row(const float* x, int64_t k, uint8_t* xq, float* s, float* sb) {
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
      std::fill(xq + b * kBlock, xq + (b + 1) * kBlock, uint8_t{128});
      continue;
    }
    s[b] = sb[b] = mx / 127.f;
    const float inv = 127.f / mx;
    for (int i = 0; i < kBlock; ++i) {
      const float v = std::nearbyint(xb[i] * inv);  // |v| <= 127: x * inv <= 127 (1 + 3u) rounds to 127 at most
      xq[b * kBlock + i] = static_cast<uint8_t>(static_cast<int>(v) + 128);
    }
  }
  return true;
}

// Rows r0.. r0 + R (their codes xq [R, K], scales s, sb [R, blocks]) against token groups g0.. g0 + kGroups:
// writes a_j + B_j to hi and raises floor[r] to max_j (a_j - B_j).
template <int R>
void screen_tile(const uint8_t* xq, const float* s, const float* sb, const Int8Head& h, int64_t g0, float* hi,
                 int64_t ldh, float* floor) {
  __m512 approx[R][kGroups], bound[R][kGroups];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < kGroups; ++g) approx[r][g] = bound[r][g] = _mm512_setzero_ps();
  const int64_t quads = h.k / 4;
  for (int64_t b = 0; b < h.blocks; ++b) {
    __m512i acc[R][kGroups];
    for (int g = 0; g < kGroups; ++g) {
      const __m512i init = _mm512_loadu_si512(h.negq + ((g0 + g) * h.blocks + b) * kGroup);
      for (int r = 0; r < R; ++r) acc[r][g] = init;
    }
#pragma GCC unroll 8
    for (int64_t i = 0; i < kBlock / 4; ++i) {
      const int64_t quad = b * (kBlock / 4) + i;
      __m512i w[kGroups];
      for (int g = 0; g < kGroups; ++g) w[g] = _mm512_loadu_si512(h.codes + ((g0 + g) * quads + quad) * 64);
      for (int r = 0; r < R; ++r) {
        const __m512i xb = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xq + r * h.k + quad * 4));
        for (int g = 0; g < kGroups; ++g) acc[r][g] = _mm512_dpbusd_epi32(acc[r][g], xb, w[g]);
      }
    }
    for (int g = 0; g < kGroups; ++g) {
      const __m512 dv = _mm512_loadu_ps(h.d + ((g0 + g) * h.blocks + b) * kGroup);
      const __m512 cv = _mm512_loadu_ps(h.c + ((g0 + g) * h.blocks + b) * kGroup);
      for (int r = 0; r < R; ++r) {
        approx[r][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][g]), _mm512_mul_ps(dv, _mm512_set1_ps(s[r * h.blocks + b])),
                                       approx[r][g]);
        bound[r][g] = _mm512_fmadd_ps(_mm512_set1_ps(sb[r * h.blocks + b]), cv, bound[r][g]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    __m512 lo = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int g = 0; g < kGroups; ++g) {
      _mm512_storeu_ps(hi + r * ldh + (g0 + g) * kGroup, _mm512_add_ps(approx[r][g], bound[r][g]));
      lo = _mm512_max_ps(lo, _mm512_sub_ps(approx[r][g], bound[r][g]));
    }
    floor[r] = std::max(floor[r], _mm512_reduce_max_ps(lo));
  }
}

using Tile = void (*)(const uint8_t*, const float*, const float*, const Int8Head&, int64_t, float*, int64_t, float*);
constexpr Tile kTiles[kRows + 1] = {nullptr, &screen_tile<1>, &screen_tile<2>, &screen_tile<3>, &screen_tile<4>};

#endif

std::tuple<at::Tensor, at::Tensor> int8_greedy_screen(const at::Tensor& x_in, const at::Tensor& codes_in,
                                                      const at::Tensor& d_in, const at::Tensor& negq_in,
                                                      const at::Tensor& c_in, const at::Tensor& weight_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "int8_greedy_screen: x float32 [rows, K]");
  TORCH_CHECK(weight_in.dim() == 2 && weight_in.scalar_type() == at::kFloat && weight_in.size(1) == x_in.size(1),
              "int8_greedy_screen: weight float32 [V, K] with x's K");
  const int64_t rows = x_in.size(0), k = x_in.size(1), vocab = weight_in.size(0), blocks = k / kBlock;
  const int64_t groups = codes_in.dim() == 4 ? codes_in.size(0) : -1;
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
  at::Tensor ids = at::zeros({rows}, x.options().dtype(at::kLong));
  at::Tensor candidates = at::zeros({rows}, x.options().dtype(at::kLong));
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  if (rows == 0) return {ids, candidates};
  const Int8Head head{codes_in.data_ptr<int8_t>(), d_in.data_ptr<float>(), negq_in.data_ptr<int32_t>(),
                      c_in.data_ptr<float>(), k, blocks};
  const float* xp = x.data_ptr<float>();
  std::vector<uint8_t> xq(rows * k);
  std::vector<float> s(rows * blocks), sb(rows * blocks);
  std::vector<char> finite(rows);
  for (int64_t r = 0; r < rows; ++r)
    finite[r] = quantize_row(xp + r * k, k, xq.data() + r * k, s.data() + r * blocks, sb.data() + r * blocks);
  at::Tensor hi_t = at::empty({rows, groups * kGroup}, x.options());
  float* hi = hi_t.data_ptr<float>();
  const int64_t ldh = groups * kGroup;
  std::vector<float> floor(rows, -std::numeric_limits<float>::infinity());
  std::mutex floor_lock;
  const int64_t tiles = groups / kGroups;
  tritonllm::parallel_claim(tiles, tritonllm::grain_for(tiles, kClaimsPerThread), [&](tritonllm::ClaimedChunks& items) {
    std::vector<float> mine(rows, -std::numeric_limits<float>::infinity());
    for (int64_t begin, end; items.next(begin, end);)
      for (int64_t t = begin; t < end; ++t)
        for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
          const int n = static_cast<int>(std::min<int64_t>(kRows, rows - r0));
          kTiles[n](xq.data() + r0 * k, s.data() + r0 * blocks, sb.data() + r0 * blocks, head, t * kGroups,
                    hi + r0 * ldh, ldh, mine.data() + r0);
        }
    std::lock_guard<std::mutex> hold(floor_lock);
    for (int64_t r = 0; r < rows; ++r) floor[r] = std::max(floor[r], mine[r]);
  });
  const float* wp = weight.data_ptr<float>();
  int64_t *ip = ids.data_ptr<int64_t>(), *cp = candidates.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> cand;
    for (int64_t r = begin; r < end; ++r) {
      if (!finite[r]) continue;  // NaN or inf in x: no logit means anything; id 0, no candidates
      cand.clear();
      const float* hr = hi + r * ldh;
      const __m512 vfloor = _mm512_set1_ps(floor[r]);
      int64_t j = 0;
      for (; j + kGroup <= vocab; j += kGroup)
        for (uint32_t hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(hr + j), vfloor, _CMP_GE_OQ); hit; hit &= hit - 1)
          cand.push_back(j + __builtin_ctz(hit));
      for (; j < vocab; ++j)
        if (hr[j] >= floor[r]) cand.push_back(j);
      ip[r] = tritonllm::rescored_argmax(xp + r * k, k, wp, cand);
      cp[r] = static_cast<int64_t>(cand.size());
    }
  });
#else
  TORCH_CHECK(false, "int8_greedy_screen: built without AVX512-VNNI");
#endif
  return {ids, candidates};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tritonllm, m) {
  m.def("int8_screen_supported() -> bool", &int8_screen_supported);  // no tensors: a catch-all kernel
  m.def("int8_greedy_screen(Tensor x, Tensor codes, Tensor d, Tensor negq, Tensor c, Tensor weight) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tritonllm, CPU, m) { m.impl("int8_greedy_screen", &int8_greedy_screen); }
