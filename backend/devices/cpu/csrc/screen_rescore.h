// What a greedy screen does with the tokens it could not rule out: their float32 logits recomputed
// with the float32 GEMM's own arithmetic (csrc/packed_gemm.cpp: from zero, one FMA per product, k in
// order), and the argmax among them, lowest index on ties. The result is the float32 head's argmax bit
// for bit whenever every token outside `candidates` is known to be below one inside.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace tritonllm {

constexpr int kRescore = 8;  // candidates recomputed per pass over x: eight independent FMA chains

// Every j < n whose upper bound, a_j + xn * bound_j (or a_j alone where `bound` is null), is at least
// `floor`, in increasing order: the tokens a screen cannot rule out. Blocks of 16 are tested whole first
// (a vectorized max: nearly every block has none).
inline void collect_candidates(const float* a, const float* bound, float xn, int64_t n, float floor,
                               std::vector<int64_t>& out) {
  constexpr int kBlock = 16;
  out.clear();
  int64_t j = 0;
  for (; j + kBlock <= n; j += kBlock) {
    float top[kBlock];
    float most = -std::numeric_limits<float>::infinity();
    for (int l = 0; l < kBlock; ++l) {
      top[l] = bound ? a[j + l] + xn * bound[j + l] : a[j + l];
      most = std::max(most, top[l]);
    }
    if (most >= floor)
      for (int l = 0; l < kBlock; ++l)
        if (top[l] >= floor) out.push_back(j + l);
  }
  for (; j < n; ++j)
    if ((bound ? a[j] + xn * bound[j] : a[j]) >= floor) out.push_back(j);
}

// The argmax over `cand` (increasing) of the float32 x . W[j] (W [V, k]); 0 where `cand` is empty.
inline int64_t rescored_argmax(const float* x, int64_t k, const float* w, const std::vector<int64_t>& cand) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_id = cand.empty() ? 0 : cand[0];
  for (size_t c0 = 0; c0 < cand.size(); c0 += kRescore) {
    const int count = static_cast<int>(std::min<size_t>(kRescore, cand.size() - c0));
    const float* row[kRescore];
    for (int j = 0; j < kRescore; ++j) row[j] = w + cand[c0 + (j < count ? j : 0)] * k;  // spare chains repeat the first
    float exact[kRescore] = {};
    for (int64_t i = 0; i < k; ++i)
      for (int j = 0; j < kRescore; ++j) exact[j] = std::fma(x[i], row[j][i], exact[j]);
    for (int j = 0; j < count; ++j)
      if (exact[j] > best) best = exact[j], best_id = cand[c0 + j];  // strict: the lowest index keeps a tie
  }
  return best_id;
}

}  // namespace tritonllm
