// The float32 greedy head's token ids from a bfloat16 LM head: a screen with a proven error bound,
// then the few tokens it cannot rule out recomputed in float32.
//
// Why: the LM head is the largest GEMM of a small model's decode step (49152 x 576 for SmolLM2), and
// a greedy row that wants no log-prob needs only its argmax. With a = the logits from bfloat16-rounded
// x and W summed in float32 (packed_gemm_bf16, about twice the float32 GEMM's rate), each product's rounding error is at most (2u + u^2)|x_i||w_i| (u = 2^-8),
// the float32 sums add at most ~K 2^-24 of sum |x_i||w_i| on either side, and Cauchy-Schwarz bounds
// that sum by ||x|| ||w_j||, so
//     |exact_j - a_j| <= B_j = ||x|| * col_bound_j,   col_bound_j = c ||w_j||   (c from Python, rounded up).
// Let L = max_k (a_k - B_k). A token with a_j + B_j < L has exact_j < exact_k for that k, so it is
// neither the argmax nor tied with it. The rest (a few tokens) get
// their float32 logit recomputed with the float32 GEMM's own arithmetic (csrc/packed_gemm.cpp: from
// zero, one FMA per product, in k order), and the argmax among them, lowest index on ties, is the
// float32 head's argmax bit for bit. The log-prob needs every logit exactly, so rows that want it
// keep the float32 head (runner/head.py).
//
#include <ATen/Parallel.h>

#include "cpu_tensors.h"
#include "ops.h"

#include "screen_rescore.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace {

// ||x|| in double, rounded up to a float: the bound must not come out smaller than the real one.
float norm_rounded_up(const float* x, int64_t k) {
  double sum = 0.0;
  for (int64_t i = 0; i < k; ++i) sum += static_cast<double>(x[i]) * x[i];
  return std::nextafter(static_cast<float>(std::sqrt(sum)), std::numeric_limits<float>::infinity());
}

// L = max_j (a_j - xn * bound_j).
float screen_floor(const float* a, const float* bound, int64_t n, float xn) {
  float floor = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) floor = std::max(floor, a[j] - xn * bound[j]);
  return floor;
}

}  // namespace

namespace tritonllm {

std::tuple<at::Tensor, at::Tensor> screened_greedy_head(const at::Tensor& x_in, const at::Tensor& approx_in,
                                                        const at::Tensor& weight_in, const at::Tensor& bound_in) {
  TORCH_CHECK(x_in.dim() == 2 && approx_in.dim() == 2 && weight_in.dim() == 2 && bound_in.dim() == 1,
              "screened_greedy_head: x [rows, K], approx [rows, V], weight [V, K], col_bounds [V]");
  for (const at::Tensor* t : {&x_in, &approx_in, &weight_in, &bound_in})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "screened_greedy_head: float32 only");
  const int64_t rows = x_in.size(0), k = x_in.size(1), vocab = weight_in.size(0);
  TORCH_CHECK(vocab > 0 && weight_in.size(1) == k && approx_in.size(0) == rows && approx_in.size(1) == vocab &&
                  bound_in.size(0) == vocab,
              "screened_greedy_head: shapes do not match (x ", x_in.sizes(), ", approx ", approx_in.sizes(),
              ", weight ", weight_in.sizes(), ", col_bounds ", bound_in.sizes(), ")");
  const at::Tensor x = x_in.contiguous(), approx = approx_in.contiguous(), weight = weight_in.contiguous(),
                   bound = bound_in.contiguous();
  at::Tensor ids = new_zeroed_tensor({rows}, x.options().dtype(at::kLong));
  at::Tensor candidates = new_zeroed_tensor({rows}, x.options().dtype(at::kLong));
  const float *xp = x.data_ptr<float>(), *ap = approx.data_ptr<float>(), *wp = weight.data_ptr<float>(),
              *bp = bound.data_ptr<float>();
  int64_t *ip = ids.data_ptr<int64_t>(), *cp = candidates.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> cand;
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * k;
      const float* ar = ap + r * vocab;
      const float xn = norm_rounded_up(xr, k);
      if (!std::isfinite(xn)) continue;  // NaN or inf in x: no logit means anything; id 0, no candidates
      tritonllm::collect_candidates(ar, bp, xn, vocab, screen_floor(ar, bp, vocab, xn), cand);
      const int64_t best_id = tritonllm::rescored_argmax(xr, k, wp, cand);
      ip[r] = best_id;
      cp[r] = static_cast<int64_t>(cand.size());
    }
  });
  return {ids, candidates};
}

}  // namespace tritonllm
