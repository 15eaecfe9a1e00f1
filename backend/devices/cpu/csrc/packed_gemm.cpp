// Our float32 GEMM for the decoder's linears on AVX-512 and AVX2 (+ FMA) CPUs: y[M, N] = x[M, K] @ W[N, K]^T + bias.
//
// Why not oneDNN: at the row counts a continuous batcher runs (1-64 rows per step) a step's GEMMs
// stream every weight from memory once, and oneDNN pays for that stream on top of the arithmetic.
// This kernel keeps the weight in one long sequential stream that the hardware prefetcher (and a
// short software prefetch on the first pass) keeps ahead of the FMAs, so the stream overlaps the
// arithmetic; the gain is largest at few rows and gone by prefill sizes (docs/PERFORMANCE.md).
//
// Layout: the weight is packed once into panels of NR = 32 output columns, each panel [K, 32]
// contiguous (the last one zero-padded), the same bytes on every build. One source serves both
// widths (panel_vectors.h: VL = 16 floats on AVX-512, 8 on AVX2): a panel's k step is 32 / VL vectors.
// The microkernel holds an MR x 32 block of y in accumulators (AVX-512: MR <= 12, 24 of the 32 zmm;
// AVX2: MR <= 3, 12 of the 16 ymm, the rest for 3 broadcasts and one panel vector at a time), and
// per k loads the panel's vectors and broadcasts one x value per row. The threads claim runs of
// panels as they go, each from its own contiguous share first (claimed_chunks.h, kOwnRuns), so each
// streams a contiguous part of the weight and a thread the OS pauses does not hold up the GEMM; rows are taken in chunks whose x slice stays in L2, which only
// matters for prefill-sized M. Sums run in k order, one FMA per product, so a row's result does
// not depend on the batch it runs in, nor on the build (AVX2 and AVX-512 give the same bits).
//
// bfloat16 weights (`cpu_gemm=avx512_bf16`, opt-in because it changes results): the same panels
// with the weight rounded to bfloat16 and k taken in pairs, [ceil(K / 2), 32, 2], so one zmm holds
// a k pair of 16 columns; x is rounded to bfloat16 per call, and `vdpbf16ps` adds both products of
// a pair into float32 accumulators: half the weight bytes and twice the products per instruction.
// Everything else in the model stays float32; only the GEMM inputs are rounded.
//
// Without AVX-512 or AVX2 + FMA at build time (the generic build) the ops exist but
// `packed_gemm_supported()` is false and the engine keeps oneDNN (devices/cpu/packed_linear.py);
// likewise `packed_gemm_bf16_supported()` without AVX512-BF16, and the engine keeps the float32 kernel.

#include <ATen/Parallel.h>

#include "cpu_tensors.h"
#include "ops.h"

#include "claimed_chunks.h"
#include "panel_vectors.h"
#include "row_blocks.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kPanel = 32;                 // NR: output columns per panel (two zmm, four ymm)
#if TRITONLLM_PANEL_GEMM && !defined(__AVX512F__)
constexpr int kMaxRows = 3;                    // MR on AVX2: 3 x 4 accumulators + the loads in 16 ymm
#else
constexpr int kMaxRows = 12;                   // MR: rows per microkernel call (24 of the 32 zmm)
#endif
constexpr int64_t kRowChunkBytes = 384 << 10;  // x rows per chunk: this many bytes of x (L2-resident)
// Software prefetch distance in panel rows (4 KiB): far enough ahead to cover DRAM latency on the first
// row block's pass, near enough to stay in L1 (the distances tried are in docs/HISTORY.md).
constexpr int64_t kPrefetchRows = 32;
constexpr int64_t kClaimsPerThread = 8;        // panel runs each thread claims per row chunk (claimed_chunks.h)

}  // namespace

namespace tritonllm {

bool packed_gemm_supported() { return TRITONLLM_PANEL_GEMM; }

// Wherever the float32 panels run: AVX512-BF16's dot product, or elsewhere the same sums in FMAs.
bool packed_gemm_bf16_supported() { return TRITONLLM_PANEL_GEMM; }

// [N, K] -> [ceil(N / 32), K, 32]: panel p holds output columns 32p .. 32p + 31, k-major.
at::Tensor pack_gemm_weight(const at::Tensor& weight_in) {
  TORCH_CHECK(weight_in.dim() == 2 && weight_in.scalar_type() == at::kFloat, "pack_gemm_weight: float32 [out, in]");
  const at::Tensor w = weight_in.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel;
  at::Tensor packed = new_zeroed_tensor({panels, k, kPanel}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < kPanel && p * kPanel + j < n; ++j) {
        const float* row = src + (p * kPanel + j) * k;
        float* col = dst + p * k * kPanel + j;
        for (int64_t i = 0; i < k; ++i) col[i * kPanel] = row[i];
      }
  });
  return packed;
}

// [N, K] float32 -> [ceil(N / 32), ceil(K / 2), 32, 2] bfloat16 (round to nearest even): panel p,
// pair i holds (W[c, 2i], W[c, 2i + 1]) for its 32 columns c; zero past N and K.
at::Tensor pack_gemm_weight_bf16(const at::Tensor& weight_in) {
  TORCH_CHECK(weight_in.dim() == 2 && weight_in.scalar_type() == at::kFloat, "pack_gemm_weight_bf16: float32 [out, in]");
  const at::Tensor w = weight_in.contiguous().to(at::kBFloat16);
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel, pairs = (k + 1) / 2;
  at::Tensor packed = new_zeroed_tensor({panels, pairs, kPanel, 2}, w.options());
  const at::BFloat16* src = w.data_ptr<at::BFloat16>();
  at::BFloat16* dst = packed.data_ptr<at::BFloat16>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < kPanel && p * kPanel + j < n; ++j) {
        const at::BFloat16* row = src + (p * kPanel + j) * k;
        at::BFloat16* col = dst + p * pairs * kPanel * 2 + j * 2;
        for (int64_t i = 0; i < k; ++i) col[(i / 2) * kPanel * 2 + (i & 1)] = row[i];
      }
  });
  return packed;
}

}  // namespace tritonllm

namespace {

#if TRITONLLM_PANEL_GEMM

using tritonllm::panel::vf;

// The two panel formats, as the microkernel sees them: a k step of a panel is 128 bytes, 32
// columns of one k (float32) or of a k pair (bfloat16), in kVectors registers; `broadcast` spreads a
// row's x for that step.
struct Float32Panels {
  using Elem = float;
  using Weights = vf;
  static constexpr int kVectors = tritonllm::panel::kPanelVectors;
  static constexpr int64_t kStep = kPanel;  // elements per k step
  static vf load(const float* p, int j) { return tritonllm::panel::load(p + j * tritonllm::panel::VL); }
  static vf broadcast(const float* x) { return tritonllm::panel::splat(*x); }
  static vf madd(vf acc, vf a, vf b) { return tritonllm::panel::fma(a, b, acc); }
};

#if defined(__AVX512F__) && defined(__AVX512BF16__)
struct Bf16PairPanels {
  using Elem = at::BFloat16;
  using Weights = __m512bh;
  static constexpr int kVectors = 2;
  static constexpr int64_t kStep = kPanel * 2;
  static __m512bh load(const at::BFloat16* p, int j) { return (__m512bh)_mm512_loadu_si512(p + j * kPanel); }
  static __m512bh broadcast(const at::BFloat16* x) {  // the pair (x[2i], x[2i + 1]) in every 32-bit lane
    int32_t pair;
    __builtin_memcpy(&pair, x, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(pair);
  }
  // Both products of the pair into each column's float32 sum.
  static vf madd(vf acc, __m512bh a, __m512bh b) { return (vf)_mm512_dpbf16_ps((__m512)acc, a, b); }
};
#else
// The same panels without AVX512-BF16: each 32-bit lane's bfloat16 pair widened to float32 by its bits,
// and the pair's products added as vdpbf16ps adds them, the odd element's first. A product of two
// bfloat16 values is exact in float32, so each FMA rounds only the sum, as vdpbf16ps does (which also
// flushes subnormal inputs and results to zero; this keeps them). Twice the float32 panels' FMAs per
// weight, half their bytes.
struct Bf16PairPanels {
  using Elem = at::BFloat16;
  using Weights = tritonllm::panel::vu32;
  static constexpr int kVectors = tritonllm::panel::kPanelVectors;  // a k pair of 32 columns: 128 bytes
  static constexpr int64_t kStep = kPanel * 2;
  static Weights load(const at::BFloat16* p, int j) {
    Weights v;
    __builtin_memcpy(&v, p + j * 2 * tritonllm::panel::VL, sizeof v);
    return v;
  }
  static Weights broadcast(const at::BFloat16* x) {  // the pair (x[2i], x[2i + 1]) in every 32-bit lane
    uint32_t pair;
    __builtin_memcpy(&pair, x, sizeof pair);
    return pair - Weights{};
  }
  static vf madd(vf acc, Weights a, Weights b) {
    namespace pv = tritonllm::panel;
    const Weights high = 0xffff0000u - Weights{};
    acc = pv::fma((vf)(a & high), (vf)(b & high), acc);
    return pv::fma((vf)(a << 16), (vf)(b << 16), acc);
  }
};
#endif

// y[0..R) x [0..32) = x[0..R) . panel (+ bias), over all `steps` k steps. `prefetch`: also pull the
// panel kPrefetchRows steps ahead into L1 (the first row block of a panel, which meets it cold).
template <typename Format, int R>
void microkernel(const typename Format::Elem* x, int64_t ldx, const typename Format::Elem* panel, int64_t steps,
                 float* y, int64_t ldy, const float* bias, bool prefetch) {
  namespace pv = tritonllm::panel;
  constexpr int V = pv::kPanelVectors, W = Format::kVectors;
  constexpr int64_t kStep = Format::kStep, kXPerStep = kStep / kPanel;
  vf acc[R][V];
  vf init[V];
#pragma GCC unroll 4
  for (int j = 0; j < V; ++j) init[j] = bias ? pv::load(bias + j * pv::VL) : pv::zero();
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < V; ++j) acc[r][j] = init[j];
  for (int64_t i = 0; i < steps; ++i) {
    const typename Format::Elem* b = panel + i * kStep;
    typename Format::Weights w[W];
#pragma GCC unroll 4
    for (int j = 0; j < W; ++j) w[j] = Format::load(b, j);
    if (prefetch) {  // the step's two cache lines
      pv::prefetch(b + kPrefetchRows * kStep);
      pv::prefetch(b + kPrefetchRows * kStep + kStep / 2);
    }
    if constexpr (V <= 2) {  // AVX-512: 2 R accumulators, the step's 2 vectors and one broadcast in 32 zmm
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        const auto a = Format::broadcast(x + r * ldx + i * kXPerStep);
#pragma GCC unroll 4
        for (int j = 0; j < V; ++j) acc[r][j] = Format::madd(acc[r][j], a, w[j]);
      }
    } else {  // AVX2: 4 R accumulators, R broadcasts and one vector at a time in 16 ymm (3 rows: all 16)
      typename Format::Weights a[R];
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) a[r] = Format::broadcast(x + r * ldx + i * kXPerStep);
#pragma GCC unroll 4
      for (int j = 0; j < V; ++j)
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) acc[r][j] = Format::madd(acc[r][j], a[r], w[j]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < V; ++j) pv::store(y + r * ldy + j * pv::VL, acc[r][j]);
}

template <typename Elem>
using Microkernel = void (*)(const Elem*, int64_t, const Elem*, int64_t, float*, int64_t, const float*, bool);
// Indexed by the row count of the block (1 .. kMaxRows): the tails of M use their own unrolling.
template <typename F, int... R>
constexpr std::array<Microkernel<typename F::Elem>, kMaxRows + 1> microkernel_table(std::integer_sequence<int, R...>) {
  return {nullptr, &microkernel<F, R + 1>...};
}
template <typename F>
constexpr auto kMicrokernels = microkernel_table<F>(std::make_integer_sequence<int, kMaxRows>{});

// y [m, n] = x [m, K] . panels: the threads claim runs of panels, rows go in chunks whose
// x stays in L2, split evenly into blocks of up to kMaxRows rows (row_blocks.h), each one microkernel
// call over the whole K.
// `steps` is K (float32) or K / 2 (bfloat16 pairs); `ldx` is x's row stride in elements.
template <typename Elem>
void run_panels(const Elem* xp, int64_t ldx, const Elem* wp, int64_t steps, int64_t panels, int64_t m, int64_t n,
                const float* bias, float* yp, const std::array<Microkernel<Elem>, kMaxRows + 1>& microkernels) {
  const int64_t panel_elems = steps * kPanel * (4 / sizeof(Elem));
  const int64_t chunk = std::max<int64_t>(kMaxRows, kRowChunkBytes / (std::max<int64_t>(ldx, 1) * sizeof(Elem)) /
                                                        kMaxRows * kMaxRows);
  const bool prefetch = m >= 4;  // a 1-3 row pass is a pure stream the hardware prefetcher keeps up with alone
  const int64_t row_chunks = (m + chunk - 1) / chunk;
  // Work items are (row chunk, panel), row chunk major: a thread's own run is consecutive panels.
  tritonllm::parallel_claim(row_chunks * panels, tritonllm::grain_for(panels, kClaimsPerThread), tritonllm::ClaimOrder::kOwnRuns,
                            [&](tritonllm::ClaimedChunks::Claimer& items) {
    alignas(64) float tail[kMaxRows * kPanel];  // the last panel's block when N is not a multiple of 32
    alignas(64) float tail_bias[kPanel] = {};   // ... and its bias, zero-padded (same arithmetic as full panels)
    for (int64_t begin, end; items.next(begin, end);) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t m0 = item / panels * chunk, p = item % panels;
        const int64_t m1 = std::min(m, m0 + chunk);
        const Elem* panel = wp + p * panel_elems;
        const int64_t col0 = p * kPanel;
        const int64_t cols = std::min(kPanel, n - col0);
        const tritonllm::RowBlocks row_blocks(m1 - m0, kMaxRows);
        for (int64_t blk = 0; blk < row_blocks.count; ++blk) {
          const int64_t r0 = m0 + row_blocks.start(blk);
          const int rows = row_blocks.rows(blk);
          const bool pf = prefetch && blk == 0;
          if (cols == kPanel) {
            microkernels[rows](xp + r0 * ldx, ldx, panel, steps, yp + r0 * n + col0, n, bias ? bias + col0 : nullptr, pf);
          } else {
            if (bias) std::copy(bias + col0, bias + n, tail_bias);
            microkernels[rows](xp + r0 * ldx, ldx, panel, steps, tail, kPanel, bias ? tail_bias : nullptr, pf);
            for (int r = 0; r < rows; ++r) std::copy(tail + r * kPanel, tail + r * kPanel + cols, yp + (r0 + r) * n + col0);
          }
        }
      }
    }
  });
}

#endif

// The checks both formats share; returns the bias pointer (or null) and keeps its tensor alive.
const float* check_gemm_args(const char* op, const at::Tensor& x_in, const at::Tensor& packed, int64_t k,
                             const c10::optional<at::Tensor>& bias_in, int64_t n, at::Tensor& bias_c) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, op, ": float32 only (x is ", x_in.scalar_type(), ")");
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == k, op, ": x's last dim ", x_in.size(-1), " != in_features ", k);
  TORCH_CHECK(n > 0 && n <= packed.size(0) * kPanel && n > (packed.size(0) - 1) * kPanel, op, ": out_features ", n,
              " does not match the packed weight");
  if (!bias_in.has_value() || !bias_in->defined()) return nullptr;
  TORCH_CHECK(bias_in->scalar_type() == at::kFloat && bias_in->numel() == n, op, ": bias [out_features] float32");
  bias_c = bias_in->contiguous();
  return bias_c.data_ptr<float>();
}

std::vector<int64_t> out_shape(const at::Tensor& x_in, int64_t n) {
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = n;
  return shape;
}

}  // namespace

namespace tritonllm {

at::Tensor packed_gemm(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias_in,
                       int64_t out_features) {
  TORCH_CHECK(packed_gemm_supported(), "packed_gemm: built without AVX-512 or AVX2 + FMA");
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(),
              "packed_gemm: weight from pack_gemm_weight");
  const int64_t k = packed.size(1), n = out_features;
  at::Tensor bias_c;
  const float* bias = check_gemm_args("packed_gemm", x_in, packed, k, bias_in, n, bias_c);
  const at::Tensor x = x_in.reshape({-1, k}).contiguous();
  const int64_t m = x.size(0);
  at::Tensor y = new_tensor({m, n}, x.options());
#if TRITONLLM_PANEL_GEMM
  run_panels<float>(x.data_ptr<float>(), k, packed.data_ptr<float>(), k, packed.size(0), m, n, bias, y.data_ptr<float>(),
                    kMicrokernels<Float32Panels>);
#endif
  return y.view(out_shape(x_in, n));
}

}  // namespace tritonllm

namespace {

#if TRITONLLM_PANEL_GEMM
// float32 -> bfloat16 bits, round to nearest even, NaN kept a (quiet) NaN: c10::BFloat16's rounding,
// so the kernel multiplies exactly what `x.to(torch.bfloat16)` holds.
inline uint16_t round_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// x [m, k] (row stride ldx) rounded to bfloat16 rows of `ld` elements (an odd k gets a zero pair
// partner) in a per-thread buffer that lives until this thread's next call: no tensor allocation
// or operator dispatch per GEMM (those cost more than the rounding at decode sizes).
const uint16_t* round_rows_to_bf16(const float* x, int64_t ldx, int64_t m, int64_t k, int64_t ld) {
  thread_local std::vector<uint16_t> buffer;
  if (static_cast<int64_t>(buffer.size()) < m * ld) buffer.resize(m * ld);
  uint16_t* out = buffer.data();
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * ldx;
    uint16_t* yr = out + r * ld;
#pragma omp simd
    for (int64_t i = 0; i < k; ++i) yr[i] = round_to_bf16(xr[i]);
    for (int64_t i = k; i < ld; ++i) yr[i] = 0;
  }
  return out;
}
#endif

}  // namespace

namespace tritonllm {

// As packed_gemm, on a weight from pack_gemm_weight_bf16; x is rounded to bfloat16 here (an odd K
// gets a zero pair partner, matching the weight's zero padding).
at::Tensor packed_gemm_bf16(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias_in,
                            int64_t out_features, int64_t in_features) {
  TORCH_CHECK(packed_gemm_bf16_supported(), "packed_gemm_bf16: built without AVX-512 or AVX2 + FMA");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(2) == kPanel &&
                  packed.size(3) == 2 && packed.is_contiguous(),
              "packed_gemm_bf16: weight from pack_gemm_weight_bf16");
  const int64_t pairs = packed.size(1), k = in_features, n = out_features;
  TORCH_CHECK((k + 1) / 2 == pairs, "packed_gemm_bf16: in_features ", k, " does not match the packed weight");
  at::Tensor bias_c;
  const float* bias = check_gemm_args("packed_gemm_bf16", x_in, packed, k, bias_in, n, bias_c);
  at::Tensor x2 = x_in.reshape({-1, k});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  const int64_t m = x2.size(0);
  at::Tensor y = new_tensor({m, n}, x2.options());
#if TRITONLLM_PANEL_GEMM
  const int64_t ld = 2 * pairs;
  const uint16_t* xb = round_rows_to_bf16(x2.data_ptr<float>(), x2.stride(0), m, k, ld);
  run_panels<at::BFloat16>(reinterpret_cast<const at::BFloat16*>(xb), ld, packed.data_ptr<at::BFloat16>(), pairs,
                           packed.size(0), m, n, bias, y.data_ptr<float>(), kMicrokernels<Bf16PairPanels>);
#endif
  return y.view(out_shape(x_in, n));
}

}  // namespace tritonllm
