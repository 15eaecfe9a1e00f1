// Our float32 GEMM for the decoder's linears on AVX-512 CPUs: y[M, N] = x[M, K] @ W[N, K]^T + bias.
//
// Why not oneDNN: at the row counts a continuous batcher runs (1-64 rows per step) a step's GEMMs
// stream every weight from memory once, and oneDNN pays for that stream on top of the arithmetic
// (its small-M rate on cold weights is ~60 % of its warm rate here). This kernel keeps the weight
// in one long sequential stream that the hardware prefetcher (and a short software prefetch on the
// first pass) keeps ahead of the FMAs, so the stream overlaps the arithmetic: measured 1.6x oneDNN
// at 1-8 rows, 1.3x at 16, 1.2x at 32-48, 1.05-1.1x at 64, equal from 128 rows on (AMD EPYC,
// AVX-512, 2 threads, the 30 layers' distinct weights; docs/PERFORMANCE.md).
//
// Layout: the weight is packed once into panels of NR = 32 output columns, each panel [K, 32]
// contiguous (the last one zero-padded). The microkernel holds an MR x 32 block of y in 2 * MR zmm
// accumulators (MR <= 12: 24 of the 32 registers), and per k loads the panel's two vectors and
// broadcasts one x value per row. Threads split the panels (contiguous ranges, so each streams its
// own part of the weight once); rows are taken in chunks whose x slice stays in L2, which only
// matters for prefill-sized M. Sums run in k order, one FMA per product, so a row's result does
// not depend on the batch it runs in.
//
// Without AVX-512 at build time the ops exist but `packed_gemm_supported()` is false and the
// engine keeps oneDNN (layers/linear.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 32;                 // NR: output columns per panel (two zmm)
constexpr int kMaxRows = 12;                   // MR: rows per microkernel call
constexpr int64_t kRowChunkBytes = 384 << 10;  // x rows per chunk: this many bytes of x (L2-resident)
constexpr int64_t kPrefetchRows = 8;           // software prefetch distance in panel rows (1 KiB)

bool packed_gemm_supported() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// [N, K] -> [ceil(N / 32), K, 32]: panel p holds output columns 32p .. 32p + 31, k-major.
at::Tensor pack_gemm_weight(const at::Tensor& weight_in) {
  TORCH_CHECK(weight_in.dim() == 2 && weight_in.scalar_type() == at::kFloat, "pack_gemm_weight: float32 [out, in]");
  const at::Tensor w = weight_in.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel;
  at::Tensor packed = at::zeros({panels, k, kPanel}, w.options());
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

#if defined(__AVX512F__)

// y[0..R) x [0..32) = x[0..R) . panel (+ bias), over the whole K. `prefetch`: also pull the panel
// kPrefetchRows ahead into L1 (the first row block of a panel, which meets it cold).
template <int R>
void microkernel(const float* x, int64_t ldx, const float* panel, int64_t k, float* y, int64_t ldy,
                 const float* bias, bool prefetch) {
  __m512 acc0[R], acc1[R];
  const __m512 init0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 init1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    acc0[r] = init0;
    acc1[r] = init1;
  }
  for (int64_t i = 0; i < k; ++i) {
    const float* b = panel + i * kPanel;
    const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16);
    if (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(b + kPrefetchRows * kPanel), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b + kPrefetchRows * kPanel + 16), _MM_HINT_T0);
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * ldx + i]);
      acc0[r] = _mm512_fmadd_ps(a, b0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(a, b1, acc1[r]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(y + r * ldy, acc0[r]);
    _mm512_storeu_ps(y + r * ldy + 16, acc1[r]);
  }
}

using Microkernel = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, const float*, bool);
// Indexed by the row count of the block (1 .. kMaxRows): the tails of M use their own unrolling.
constexpr Microkernel kMicrokernels[kMaxRows + 1] = {
    nullptr, &microkernel<1>, &microkernel<2>, &microkernel<3>, &microkernel<4>, &microkernel<5>, &microkernel<6>,
    &microkernel<7>, &microkernel<8>, &microkernel<9>, &microkernel<10>, &microkernel<11>, &microkernel<12>};

#endif

at::Tensor packed_gemm(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias_in,
                       int64_t out_features) {
  TORCH_CHECK(packed_gemm_supported(), "packed_gemm: built without AVX-512");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "packed_gemm: float32 only");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(), "packed_gemm: weight from pack_gemm_weight");
  const int64_t k = packed.size(1), n = out_features;
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == k, "packed_gemm: x's last dim ", x_in.size(-1), " != in_features ", k);
  TORCH_CHECK(n > 0 && n <= packed.size(0) * kPanel && n > (packed.size(0) - 1) * kPanel, "packed_gemm: out_features ", n,
              " does not match the packed weight");
  const float* bias = nullptr;
  at::Tensor bias_c;
  if (bias_in.has_value() && bias_in->defined()) {
    TORCH_CHECK(bias_in->scalar_type() == at::kFloat && bias_in->numel() == n, "packed_gemm: bias [out_features] float32");
    bias_c = bias_in->contiguous();
    bias = bias_c.data_ptr<float>();
  }
  const at::Tensor x = x_in.reshape({-1, k}).contiguous();
  const int64_t m = x.size(0);
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = n;
  at::Tensor y = at::empty({m, n}, x.options());
#if defined(__AVX512F__)
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t panels = packed.size(0);
  const int64_t chunk = std::max<int64_t>(kMaxRows, kRowChunkBytes / (std::max<int64_t>(k, 1) * 4) / kMaxRows * kMaxRows);
  const bool prefetch = m >= 4;  // a 1-3 row pass is a pure stream the hardware prefetcher keeps up with alone
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    alignas(64) float tail[kMaxRows * kPanel];  // the last panel's block when N is not a multiple of 32
    alignas(64) float tail_bias[kPanel] = {};   // ... and its bias, zero-padded (same arithmetic as full panels)
    for (int64_t m0 = 0; m0 < m; m0 += chunk) {
      const int64_t m1 = std::min(m, m0 + chunk);
      for (int64_t p = p0; p < p1; ++p) {
        const float* panel = wp + p * k * kPanel;
        const int64_t col0 = p * kPanel;
        const int64_t cols = std::min(kPanel, n - col0);
        for (int64_t r0 = m0; r0 < m1; r0 += kMaxRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m1 - r0));
          const bool pf = prefetch && r0 == m0;
          if (cols == kPanel) {
            kMicrokernels[rows](xp + r0 * k, k, panel, k, yp + r0 * n + col0, n, bias ? bias + col0 : nullptr, pf);
          } else {
            if (bias) std::copy(bias + col0, bias + n, tail_bias);
            kMicrokernels[rows](xp + r0 * k, k, panel, k, tail, kPanel, bias ? tail_bias : nullptr, pf);
            for (int r = 0; r < rows; ++r) std::copy(tail + r * kPanel, tail + r * kPanel + cols, yp + (r0 + r) * n + col0);
          }
        }
      }
    }
  });
#endif
  return y.view(out_shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tritonllm, m) {
  m.def("packed_gemm_supported() -> bool", &packed_gemm_supported);  // no tensors: a catch-all kernel
  m.def("pack_gemm_weight(Tensor weight) -> Tensor");
  m.def("packed_gemm(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(tritonllm, CPU, m) {
  m.impl("pack_gemm_weight", &pack_gemm_weight);
  m.impl("packed_gemm", &packed_gemm);
}
