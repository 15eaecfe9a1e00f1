// What a greedy screen does with the tokens it could not rule out: their float32 logits recomputed
// with the float32 GEMM's own arithmetic (csrc/packed_gemm.cpp: from zero, one FMA per product, k in
// order), and the argmax among them, lowest index on ties. The result is the float32 head's argmax bit
// for bit whenever every token outside `candidates` is known to be below one inside.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace tritonllm {

constexpr int kRescore = 8;  // candidates recomputed per pass over x (64-bit gather indices: 8 lanes)

// The float32 logits of up to 8 candidate rows of W [V, ldw], each lane summed as the float32 GEMM sums one output.
inline __m256 exact_logits(const float* x, int64_t k, const float* w, int64_t ldw, const int64_t* cand, int count) {
  alignas(64) int64_t offsets[kRescore];
  for (int i = 0; i < kRescore; ++i) offsets[i] = cand[i < count ? i : 0] * ldw;  // spare lanes repeat the first
  const __m512i vofs = _mm512_load_si512(offsets);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i)
    acc = _mm256_fmadd_ps(_mm256_set1_ps(x[i]), _mm512_i64gather_ps(vofs, w + i, sizeof(float)), acc);
  return acc;
}

// The argmax over `cand` (increasing) of the float32 x . W[j]; 0 where `cand` is empty.
inline int64_t rescored_argmax(const float* x, int64_t k, const float* w, const std::vector<int64_t>& cand) {
  alignas(32) float exact[kRescore];
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_id = cand.empty() ? 0 : cand[0];
  for (size_t c0 = 0; c0 < cand.size(); c0 += kRescore) {
    const int count = static_cast<int>(std::min<size_t>(kRescore, cand.size() - c0));
    _mm256_store_ps(exact, exact_logits(x, k, w, k, cand.data() + c0, count));
    for (int i = 0; i < count; ++i)
      if (exact[i] > best) best = exact[i], best_id = cand[c0 + i];  // strict: the lowest index keeps a tie
  }
  return best_id;
}

}  // namespace tritonllm

#endif
