// The fused greedy head for CPUs: per row of the step's logits, the argmax and, where asked, its
// log-prob (-log(sum(exp(logits - max)))) in one parallel pass over the rows. torch's path is three
// reductions and an in-place exp over [batch, vocab] (max with indices alone runs at ~2 G elements/s
// here); this reads each row from memory once and keeps it in cache for the log-prob's pass. A step
// whose rows want no log-prob (most greedy requests) skips that pass, which costs several times the
// argmax's: an exp per logit.
//
// float32 only. Ties go to the lowest index, as torch's max/argmax. The exp argument is clamped at
// -87 (exp(-87) < 1e-37 against a sum of at least 1) so -ffast-math never meets an infinity.

#include <ATen/Parallel.h>

#include "cpu_tensors.h"
#include "ops.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// The first index of the row's largest value (NaNs are passed over, as std::max passes them over).
// Each lane keeps its own largest value and the first index it met it at; the row's answer is the
// lowest such index among the lanes holding the row's largest value.
int64_t first_argmax(const float* x, int64_t n, float& best) {
  int64_t i = 0, arg = 0;
  best = -FLT_MAX;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 vbest = _mm512_set1_ps(-FLT_MAX);
    __m512i varg = _mm512_setzero_si512(), vidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i sixteen = _mm512_set1_epi32(16);
    for (; i + 16 <= n; i += 16, vidx = _mm512_add_epi32(vidx, sixteen)) {
      const __m512 v = _mm512_loadu_ps(x + i);
      const __mmask16 more = _mm512_cmp_ps_mask(v, vbest, _CMP_GT_OQ);  // strict: a lane keeps its first
      vbest = _mm512_mask_mov_ps(vbest, more, v);
      varg = _mm512_mask_mov_epi32(varg, more, vidx);
    }
    best = _mm512_reduce_max_ps(vbest);
    const __mmask16 holding = _mm512_cmp_ps_mask(vbest, _mm512_set1_ps(best), _CMP_EQ_OQ);
    arg = _mm512_mask_reduce_min_epi32(holding, varg);
  }
#elif defined(__AVX2__)
  // Four lanes of 8 side by side: one would wait on its compare-and-blend chain every 8 values.
  constexpr int kSets = 4;
  if (n >= 8 * kSets) {
    __m256 vbest[kSets];
    __m256i varg[kSets], vidx[kSets];
    for (int s = 0; s < kSets; ++s) {
      vbest[s] = _mm256_set1_ps(-FLT_MAX);
      varg[s] = _mm256_setzero_si256();
      vidx[s] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * s));
    }
    const __m256i step = _mm256_set1_epi32(8 * kSets);
    for (; i + 8 * kSets <= n; i += 8 * kSets)
      for (int s = 0; s < kSets; ++s) {
        const __m256 v = _mm256_loadu_ps(x + i + 8 * s);
        const __m256 more = _mm256_cmp_ps(v, vbest[s], _CMP_GT_OQ);  // strict: a lane keeps its first
        vbest[s] = _mm256_blendv_ps(vbest[s], v, more);
        varg[s] = _mm256_castps_si256(
            _mm256_blendv_ps(_mm256_castsi256_ps(varg[s]), _mm256_castsi256_ps(vidx[s]), more));
        vidx[s] = _mm256_add_epi32(vidx[s], step);
      }
    alignas(32) float lane_best[8 * kSets];
    alignas(32) int32_t lane_arg[8 * kSets];
    for (int s = 0; s < kSets; ++s) {
      _mm256_store_ps(lane_best + 8 * s, vbest[s]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(lane_arg + 8 * s), varg[s]);
    }
    for (int l = 0; l < 8 * kSets; ++l) best = std::max(best, lane_best[l]);
    arg = n;
    for (int l = 0; l < 8 * kSets; ++l)
      if (lane_best[l] == best) arg = std::min<int64_t>(arg, lane_arg[l]);
  }
#endif
  for (; i < n; ++i)
    if (x[i] > best) best = x[i], arg = i;
  return arg;
}

}  // namespace

namespace tritonllm {

std::tuple<at::Tensor, at::Tensor> greedy_head(const at::Tensor& logits_in, bool logprobs_wanted) {
  TORCH_CHECK(logits_in.dim() == 2 && logits_in.size(1) > 0, "greedy_head: logits [batch, vocab]");
  TORCH_CHECK(logits_in.scalar_type() == at::kFloat, "greedy_head: float32 only");
  TORCH_CHECK(logits_in.size(1) <= std::numeric_limits<int32_t>::max(), "greedy_head: vocab too large");
  const at::Tensor logits = logits_in.contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  at::Tensor ids = new_tensor({rows}, logits.options().dtype(at::kLong));
  at::Tensor logprobs = new_tensor({rows}, logits.options());
  const float* lp = logits.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* op = logprobs.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = lp + r * vocab;
      float mx;
      ip[r] = first_argmax(x, vocab, mx);
      if (!logprobs_wanted) {
        op[r] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < vocab; ++i) sum += std::exp(std::max(x[i] - mx, -87.f));
      op[r] = -std::log(sum);
    }
  });
  return {ids, logprobs};
}

}  // namespace tritonllm
