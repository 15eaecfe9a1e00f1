// The exact-block GEMM (exact_block_gemm.cpp's weights, y = x @ W^T + bias) on AMX tiles, with
// float32 accuracy: for CPUs with AMX-BF16 (Intel Xeon 4th generation and later).
//
// Why: a decode step of 64 rows is bound by FMAs, and an AMX tile multiply does 16 x 16 x 32
// bfloat16 products with float32 sums per instruction, ~16x an AVX-512 FMA's work. bfloat16 alone
// would round x and W; here nothing is rounded:
//   - the weight enters as its block codes q (0..15 for Q4_1, -128..127 for Q8_0), which bfloat16
//     holds exactly; the block's d (and m) are applied in float32 after the block's 32 products, as
//     y += d * sum(x q) + m * sum(x) (W = d q + m up to the weight's own float32 rounding);
//   - x is split into three bfloat16 parts, x = x1 + x2 + x3 exactly (8 significant bits each), and
//     each part meets the same codes, so every product is exact and only the float32 sums round.
// So the result is a float32 GEMM's up to summation order (measured: no larger error than a
// sequential float32 FMA loop against float64), not bit for bit packed_gemm's. A row's result does
// not depend on the other rows or on the batch size: every row count takes this same path, so the
// engine gives a sequence the same numbers whatever it is batched with. bfloat16-valued weights
// (no scales) take the three parts over all of K in one accumulation.
//
// Layout: the weight is pack_block_weight's (32-column panels); a thread widens one panel's codes to
// the tiles' pair-interleaved bfloat16 layout once per call (`run`), so no second copy of the weight
// is kept: 4-bit codes stream from memory at an eighth of the float32 bytes.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "block_gemm_call.h"
#include "claimed_chunks.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define TRITONLLM_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kPanel = 32;   // output columns per panel: two 16-column tiles
constexpr int64_t kBlock = 32;   // k values per scale, and per tile multiply (32 bfloat16 = 64 bytes)
constexpr int kParts = 3;        // bfloat16 parts of x
constexpr int64_t kClaimsPerThread = 4;

#if defined(TRITONLLM_AMX)

// Linux hands out the AMX register state only to processes that ask for it.
bool amx_permitted() {
  static std::once_flag once;
  static bool permitted = false;
  std::call_once(once, [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    permitted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  });
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C[row tile][column tile]; 4, 5: A (x parts) of the two row tiles; 6, 7: B (codes).
void configure_tiles(int rows) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = static_cast<uint8_t>(t >= 6 ? kBlock / 2 : rows);
  }
  _tile_loadconfig(&config);
}

// Widening one k pair (k0, k1) of a panel's 32 columns, given as float32 (exact small integers or
// bfloat16 values), into the tiles' layout: row kp of the B tile holds (k0, k1) per column.
inline void store_pair(__m512 k0_lo, __m512 k1_lo, __m512 k0_hi, __m512 k1_hi, uint16_t* b_lo, uint16_t* b_hi) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  _mm512_store_si512(b_lo, _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(k1_lo, k0_lo)));
  _mm512_store_si512(b_hi, _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(k1_hi, k0_hi)));
}

// A format widens a panel's codes for one k step into two float32 zmm (columns 0-15, 16-31).
struct Q4Codes {
  static constexpr int64_t kCodeBytes = kPanel / 2, kScaleFloats = 2 * kPanel;
  static constexpr bool kScaled = true, kMin = true;
  static void widen(const uint8_t* c, __m512& lo, __m512& hi) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xf)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  }
};

struct Q8Codes {
  static constexpr int64_t kCodeBytes = kPanel, kScaleFloats = kPanel;
  static constexpr bool kScaled = true, kMin = false;
  static void widen(const uint8_t* c, __m512& lo, __m512& hi) {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16))));
  }
};

struct Bf16Codes {
  static constexpr int64_t kCodeBytes = 2 * kPanel, kScaleFloats = 0;
  static constexpr bool kScaled = false, kMin = false;
  static void widen(const uint8_t* c, __m512& lo, __m512& hi) {
    const __m512i v = _mm512_loadu_si512(c);
    lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
    hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
  }
};

// b [2 column tiles][16 k pairs][32] bfloat16 from one block of a panel's codes [k][kCodeBytes].
template <typename F>
void widen_block(const uint8_t* codes, uint16_t* b) {
  for (int64_t kp = 0; kp < kBlock / 2; ++kp) {
    const uint8_t* c = codes + 2 * kp * F::kCodeBytes;
    __m512 k0_lo, k0_hi, k1_lo, k1_hi;
    F::widen(c, k0_lo, k0_hi);
    F::widen(c + F::kCodeBytes, k1_lo, k1_hi);
    store_pair(k0_lo, k1_lo, k0_hi, k1_hi, b + kp * 32, b + kBlock * 16 + kp * 32);
  }
}

// x [m, k] float32 -> parts [3][stride][k] bfloat16 with x = x1 + x2 + x3 exactly (each part the previous
// remainder truncated to bfloat16: the remainders are exact float32 differences), and the per-block
// sums of x [m][k / 32] (for Q4_1's m).
void split_rows(const float* x, int64_t m, int64_t stride, int64_t k, uint16_t* parts, float* block_sums, bool sums) {
  at::parallel_for(0, m, 4, [&](int64_t r0, int64_t r1) {
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t i = 0; i < k; i += 16) {
        __m512 rest = _mm512_loadu_ps(x + r * k + i);
        if (sums && i % kBlock == 0) block_sums[r * (k / kBlock) + i / kBlock] = 0.0f;
        if (sums) block_sums[r * (k / kBlock) + i / kBlock] += _mm512_reduce_add_ps(rest);
        for (int p = 0; p < kParts; ++p) {
          const __m512i bits = _mm512_and_si512(_mm512_castps_si512(rest), high);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(parts + (p * stride + r) * k + i),
                              _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
          rest = _mm512_sub_ps(rest, _mm512_castsi512_ps(bits));
        }
      }
  });
}

// acc [rows][32] += d * c + s * m for one block's two column tiles of products c (tile memory);
// bfloat16 values (no scales): acc += c.
template <typename F>
inline void add_block(float (*acc)[kPanel], const float (*c_lo)[16], const float (*c_hi)[16], int rows,
                      const float* scales, const float* sums, int64_t sums_stride) {
  __m512 d_lo = _mm512_set1_ps(1.0f), d_hi = d_lo, m_lo = _mm512_setzero_ps(), m_hi = m_lo;
  if (F::kScaled) d_lo = _mm512_loadu_ps(scales), d_hi = _mm512_loadu_ps(scales + 16);
  if (F::kMin) m_lo = _mm512_loadu_ps(scales + kPanel), m_hi = _mm512_loadu_ps(scales + kPanel + 16);
  for (int r = 0; r < rows; ++r) {
    __m512 lo = _mm512_fmadd_ps(_mm512_load_ps(c_lo[r]), d_lo, _mm512_load_ps(acc[r]));
    __m512 hi = _mm512_fmadd_ps(_mm512_load_ps(c_hi[r]), d_hi, _mm512_load_ps(acc[r] + 16));
    if (F::kMin) {
      const __m512 s = _mm512_set1_ps(sums[r * sums_stride]);
      lo = _mm512_fmadd_ps(s, m_lo, lo);
      hi = _mm512_fmadd_ps(s, m_hi, hi);
    }
    _mm512_store_ps(acc[r], lo);
    _mm512_store_ps(acc[r] + 16, hi);
  }
}

// The tile intrinsics are statement macros: these name the C tiles' zeroing and storing.
template <int RowTiles>
inline void zero_products() {
  _tile_zero(0);
  _tile_zero(1);
  if (RowTiles == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
}

template <int RowTiles>
inline void store_products(float (*c)[16][16]) {
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  if (RowTiles == 2) {
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
  }
}

// acc[0 .. RowTiles * 16) += one block's products for one or two 16-row tiles starting at row r0,
// with the block's B tiles already in tiles 6 and 7.
template <typename F, int RowTiles>
inline void multiply_block(const uint16_t* parts, int64_t stride, int64_t k, int64_t r0, int64_t blk,
                           const float* scales, const float* block_sums, int tile_rows, float (*acc)[kPanel]) {
  alignas(64) float c[4][16][16];
  const int64_t blocks = k / kBlock;
  zero_products<RowTiles>();
  for (int p = 0; p < kParts; ++p) {
    const uint16_t* a = parts + (p * stride + r0) * k + blk * kBlock;
    _tile_loadd(4, a, k * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (RowTiles == 2) {
      _tile_loadd(5, a + 16 * k, k * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  store_products<RowTiles>(c);
  const float* s = scales + blk * F::kScaleFloats;
  const float* sums = block_sums + r0 * blocks + blk;
  add_block<F>(acc, c[0], c[1], tile_rows, s, sums, blocks);
  if (RowTiles == 2) add_block<F>(acc + 16, c[2], c[3], tile_rows, s, sums + 16 * blocks, blocks);
}

// Rows go in chunks of up to kChunkTiles 16-row tiles (the accumulators of a chunk's 32 columns stay in
// L1). A panel's blocks are widened once, into a per-thread buffer (2 KB a block: 36 KB at K = 576, in
// L2) that every chunk reads; the first chunk widens block b + 1 before it multiplies block b, so the
// tiles never load what was just stored, and the widening overlaps the tile multiplies.
constexpr int64_t kChunkTiles = 2;

template <typename F>
void run(const float* x, int64_t m, int64_t k, const uint8_t* codes, const float* scales, int64_t panels, int64_t n,
         const float* bias, float* y) {
  // Below 16 rows the tiles are configured to m rows (no padded work); above, the last tile is zero-padded.
  const int tile_rows = static_cast<int>(std::min<int64_t>(m, 16));
  const int64_t row_tiles = (m + 15) / 16, padded = row_tiles * 16;
  const int64_t blocks = k / kBlock, block_values = 2 * kBlock * 16;
  // Written by split_rows but for the padding rows past m, zeroed here (a prompt's parts run to megabytes).
  std::unique_ptr<uint16_t[]> parts_buffer(new uint16_t[static_cast<size_t>(kParts * padded * k)]);
  uint16_t* parts = parts_buffer.get();
  for (int p = 0; p < kParts && padded > m; ++p)
    std::memset(parts + (p * padded + m) * k, 0, sizeof(uint16_t) * (padded - m) * k);
  std::vector<float> block_sums(static_cast<size_t>(padded * blocks), 0.0f);
  split_rows(x, m, padded, k, parts, block_sums.data(), F::kMin);
  tritonllm::parallel_claim(panels, tritonllm::grain_for(panels, kClaimsPerThread), [&](tritonllm::ClaimedChunks& items) {
    configure_tiles(tile_rows);
    std::vector<uint16_t> widened(static_cast<size_t>(blocks * block_values + 32));
    uint16_t* wb = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(widened.data()) + 63) & ~uintptr_t(63));
    alignas(64) float acc[kChunkTiles * 16][kPanel];
    for (int64_t begin, end; items.next(begin, end);)
      for (int64_t p = begin; p < end; ++p) {
        const uint8_t* pc = codes + p * k * F::kCodeBytes;
        const float* ps = scales + p * blocks * F::kScaleFloats;
        const int64_t col0 = p * kPanel, cols = std::min(kPanel, n - col0);
        widen_block<F>(pc, wb);
        for (int64_t t0 = 0; t0 < row_tiles; t0 += kChunkTiles) {
          const int64_t tiles = std::min(kChunkTiles, row_tiles - t0);
          std::memset(acc, 0, sizeof(acc));
          for (int64_t blk = 0; blk < blocks; ++blk) {
            if (t0 == 0 && blk + 1 < blocks)
              widen_block<F>(pc + (blk + 1) * kBlock * F::kCodeBytes, wb + (blk + 1) * block_values);
            _tile_loadd(6, wb + blk * block_values, 64);
            _tile_loadd(7, wb + blk * block_values + kBlock * 16, 64);
            for (int64_t t = 0; t < tiles; t += 2) {
              const int64_t r0 = (t0 + t) * 16;
              if (t + 1 < tiles) multiply_block<F, 2>(parts, padded, k, r0, blk, ps, block_sums.data(), tile_rows, acc + t * 16);
              else multiply_block<F, 1>(parts, padded, k, r0, blk, ps, block_sums.data(), tile_rows, acc + t * 16);
            }
          }
          for (int64_t r = 0; r < tiles * 16 && t0 * 16 + r < m; ++r) {
            float* out = y + (t0 * 16 + r) * n + col0;
            for (int64_t j = 0; j < cols; ++j) out[j] = bias ? acc[r][j] + bias[col0 + j] : acc[r][j];
          }
        }
      }
    _tile_release();
  });
}

#endif

bool amx_block_gemm_supported() {
#if defined(TRITONLLM_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

at::Tensor amx_block_gemm(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& bias_in, int64_t out_features) {
#if defined(TRITONLLM_AMX)
  TORCH_CHECK(amx_permitted(), "amx_block_gemm: this CPU or kernel gives no AMX tiles");
  const tritonllm::BlockGemmCall call("amx_block_gemm", x_in, codes, scales, bias_in, out_features);
  if (call.m > 0) {
    call.by_format<Q4Codes, Q8Codes, Bf16Codes>([&](auto format) {
      run<decltype(format)>(call.x.data_ptr<float>(), call.m, call.k, call.codes, call.scales, call.panels, call.n,
                            call.bias, call.y.data_ptr<float>());
    });
  }
  return call.result();
#else
  TORCH_CHECK(false, "amx_block_gemm: built without AMX");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tritonllm, m) {
  m.def("amx_block_gemm_supported() -> bool", &amx_block_gemm_supported);  // no tensors: a catch-all kernel
  m.def("amx_block_gemm(Tensor x, Tensor codes, Tensor scales, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(tritonllm, CPU, m) {
  m.impl("amx_block_gemm", &amx_block_gemm);
}
