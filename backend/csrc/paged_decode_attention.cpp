// Paged decode attention for CPUs: one query token per sequence, K and V read in place from the
// block pool, so no step copies a sequence's context (the torch path gathers every block first).
//
// Layout (layers/attention.py): q [batch, heads, head_dim]; k_cache, v_cache [kv_heads, num_blocks,
// block_size, head_dim]; block_tables [batch, max_blocks] int64; mask [batch, max_blocks * block_size]
// bool (true = attend: inside the context and not pruned). float32 only.
//
// One work item is (sequence, KV head): its query heads share every K/V row it reads. Items are
// visited shortest and longest sequence alternately so the two halves that at::parallel_for hands
// to the threads hold about the same number of keys (decodes arrive sorted by length).
// K and V are read in one pass, block by block (online softmax): score the block's keys, update each
// query head's running max, sum and output (rescaled only when the max grows), add the block's V
// rows. The next block's lines are prefetched: blocks are scattered 4 KB pages.
// Built with -ffast-math: nothing here produces an infinity or a NaN (masked keys are skipped,
// never scored), which that flag requires.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <vector>

namespace {

at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables_in, const at::Tensor& mask_in, double scale) {
  TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode_attention: q [B,H,D], k/v cache [KVH,NB,BS,D]");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
              v_cache.scalar_type() == at::kFloat, "paged_decode_attention: float32 only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode_attention: contiguous pool");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor tables = block_tables_in.to(at::kLong).contiguous();
  const at::Tensor mask = mask_in.to(at::kBool).contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), NB = k_cache.size(1), BS = k_cache.size(2);
  const int64_t MAXB = tables.size(1), W = MAXB * BS;
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0, "paged_decode_attention: head shapes");
  TORCH_CHECK(tables.size(0) == B && mask.numel() == B * W, "paged_decode_attention: table/mask shapes");
  const int64_t G = H / KVH;  // query heads per KV head
  at::Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const bool* mp = mask.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  for (int64_t i = 0; i < B * MAXB; ++i) {
    TORCH_CHECK(tp[i] >= 0 && tp[i] < NB, "paged_decode_attention: block id out of range");
  }

  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * BS), row_max(G), row_sum(G);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t k = item / KVH, h = item % KVH;
      const int64_t b = (k % 2 == 0) ? k / 2 : B - 1 - k / 2;  // shortest, longest, next shortest, ...
      const float* qh = qp + (b * H + h * G) * D;
      const int64_t* table = tp + b * MAXB;
      const bool* m = mp + b * W;
      float* oh = op + (b * H + h * G) * D;
      std::fill(oh, oh + G * D, 0.f);
      std::fill(row_max.begin(), row_max.end(), -FLT_MAX);
      std::fill(row_sum.begin(), row_sum.end(), 0.f);
      for (int64_t j = 0; j < MAXB; ++j) {
        const bool* mb = m + j * BS;
        int64_t valid = 0;
        for (int64_t t = 0; t < BS; ++t) valid += mb[t];
        if (valid == 0) continue;  // padding or a pruned block
        if (j + 1 < MAXB) {  // the next block's K and V lines: its own pages, which the hardware cannot guess
          const char* nk = reinterpret_cast<const char*>(kp + ((h * NB + table[j + 1]) * BS) * D);
          const char* nv = reinterpret_cast<const char*>(vp + ((h * NB + table[j + 1]) * BS) * D);
          for (int64_t off = 0; off < BS * D * 4; off += 64) {
            __builtin_prefetch(nk + off, 0, 2);
            __builtin_prefetch(nv + off, 0, 2);
          }
        }
        const float* kb = kp + ((h * NB + table[j]) * BS) * D;
        const float* vb = vp + ((h * NB + table[j]) * BS) * D;
        // This block's scores, then an online-softmax update of each query head's running max,
        // sum and output (rescaled only when the max grows), then its V rows: one pass over K and V.
        for (int64_t g = 0; g < G; ++g) {
          const float* qr = qh + g * D;
          float* s = scores.data() + g * BS;
          float bmax = -FLT_MAX;
          for (int64_t t = 0; t < BS; ++t) {
            if (!mb[t]) continue;
            const float* kr = kb + t * D;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int64_t d = 0; d < D; ++d) acc += qr[d] * kr[d];
            s[t] = acc * fscale;
            bmax = std::max(bmax, s[t]);
          }
          float* o = oh + g * D;
          if (bmax > row_max[g]) {
            const float corr = row_max[g] == -FLT_MAX ? 0.f : std::exp(row_max[g] - bmax);
            row_sum[g] *= corr;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) o[d] *= corr;
            row_max[g] = bmax;
          }
          const float mx = row_max[g];
          for (int64_t t = 0; t < BS; ++t) {
            if (!mb[t]) continue;
            const float p = std::exp(s[t] - mx);
            row_sum[g] += p;
            const float* vr = vb + t * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) o[d] += p * vr[d];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const float inv = row_sum[g] > 0.f ? 1.f / row_sum[g] : 0.f;
        float* o = oh + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tritonllm, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor mask, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tritonllm, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
