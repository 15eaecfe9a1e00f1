// Fused elementwise ops of the decoder layer for CPUs: each replaces several eager torch ops (and
// their temporaries) with one pass over the step's activations. At decode sizes ([64, 576]) an eager
// op costs more in dispatch and allocation than in arithmetic, and a layer ran about twenty of them.
//
// - add_rms_norm_: residual += x, then RMSNorm(residual) * weight (the residual add between a
//   layer's attention and its MLP, and between layers, folded into the next norm).
// - rope_write_kv: rotary embedding of Q and K (rotate-half convention) straight out of the fused
//   QKV projection, the rotated K and the V written into the paged pool at the step's slots; returns
//   the rotated Q. The pool may be float16 or bfloat16 (`kv_cache_dtype`): K and V are rounded to it
//   (to nearest even, as torch's .to()) as they are stored.
// - silu_mul: SiLU(gate) * up from the fused gate/up projection.
//
// float32 activations only (the CPU default); the computation per element is the reference one, only the
// summation order of RMSNorm's mean and FMA contraction differ (-ffast-math), ~1e-7 relative.
// SiLU's exp argument is clamped so that -ffast-math never meets an infinity.

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <ATen/Parallel.h>

#include "cpu_tensors.h"
#include "ops.h"

#include <algorithm>
#include <cmath>

namespace {

void check_float(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, what, ": float32 only");
  TORCH_CHECK(t.is_contiguous(), what, ": contiguous tensors only");
}

// Rows of [rows, hidden]; one parallel grain is enough rows to amortise a thread hand-off.
constexpr int64_t kRowGrain = 8;

}  // namespace

namespace tritonllm {

at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_float(residual, "add_rms_norm_");
  check_float(x, "add_rms_norm_");
  check_float(weight, "add_rms_norm_");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.dim() == 2 && weight.numel() == residual.size(1),
              "add_rms_norm_: residual and x [tokens, hidden], weight [hidden]");
  const int64_t rows = residual.size(0), n = residual.size(1);
  at::Tensor out = new_tensor(residual.sizes(), residual.options());
  float* rp = residual.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* res = rp + r * n;
      const float* xr = xp + r * n;
      float sq = 0.f;
#pragma omp simd reduction(+ : sq)
      for (int64_t i = 0; i < n; ++i) {
        const float v = res[i] + xr[i];
        res[i] = v;
        sq += v * v;
      }
      const float inv = 1.f / std::sqrt(sq / static_cast<float>(n) + feps);
      float* o = op + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = wp[i] * (res[i] * inv);
    }
  });
  return out;
}

}  // namespace tritonllm

namespace {

template <typename Elem>  // the pool's element type
void rope_write_rows(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                     at::Tensor& v_cache, const int64_t* sp, at::Tensor& q_out, int64_t num_heads, int64_t num_kv_heads) {
  const int64_t tokens = qkv.size(0), D = qkv.size(2), half = D / 2;
  const int64_t num_slots = k_cache.size(1) * k_cache.size(2);
  const float* src = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* snp = sin.data_ptr<float>();
  float* qp = q_out.data_ptr<float>();
  Elem* kp = k_cache.data_ptr<Elem>();
  Elem* vp = v_cache.data_ptr<Elem>();
  const int64_t row = (num_heads + 2 * num_kv_heads) * D;
  at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* x = src + t * row;
      const float* c = cp + t * D;
      const float* s = snp + t * D;
      // Q heads, then K heads: out = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1].
      for (int64_t h = 0; h < num_heads; ++h) {
        const float* xh = x + h * D;
        float* dst = qp + (t * num_heads + h) * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          dst[i] = xh[i] * c[i] - xh[i + half] * s[i];
          dst[i + half] = xh[i + half] * c[i + half] + xh[i] * s[i + half];
        }
      }
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const float* xh = x + (num_heads + h) * D;
        Elem* dst = kp + (h * num_slots + sp[t]) * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          dst[i] = static_cast<Elem>(xh[i] * c[i] - xh[i + half] * s[i]);
          dst[i + half] = static_cast<Elem>(xh[i + half] * c[i + half] + xh[i] * s[i + half]);
        }
      }
      const float* v = x + (num_heads + num_kv_heads) * D;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        Elem* dst = vp + (h * num_slots + sp[t]) * D;
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<Elem>(v[h * D + i]);
      }
    }
  });
}

}  // namespace

namespace tritonllm {

at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                         at::Tensor& v_cache, const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads) {
  check_float(qkv, "rope_write_kv");
  check_float(cos, "rope_write_kv");
  check_float(sin, "rope_write_kv");
  const at::ScalarType kv = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == kv && (kv == at::kFloat || kv == at::kHalf || kv == at::kBFloat16),
              "rope_write_kv: a float32, float16 or bfloat16 pool");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "rope_write_kv: contiguous pool");
  TORCH_CHECK(qkv.dim() == 3 && qkv.size(1) == num_heads + 2 * num_kv_heads,
              "rope_write_kv: qkv [tokens, heads + 2 * kv_heads, head_dim]");
  const int64_t T = qkv.size(0), D = qkv.size(2);
  TORCH_CHECK(D % 2 == 0 && cos.numel() == T * D && sin.numel() == T * D, "rope_write_kv: cos/sin [tokens, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(0) == num_kv_heads && k_cache.size(3) == D &&
              v_cache.sizes() == k_cache.sizes(), "rope_write_kv: caches [kv_heads, blocks, block_size, head_dim]");
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == T, "rope_write_kv: one slot per token");
  const int64_t num_slots = k_cache.size(1) * k_cache.size(2);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "rope_write_kv: slot out of range");
  }
  at::Tensor q_out = new_tensor({T, num_heads, D}, qkv.options());
  if (kv == at::kHalf) {
    rope_write_rows<c10::Half>(qkv, cos, sin, k_cache, v_cache, sp, q_out, num_heads, num_kv_heads);
  } else if (kv == at::kBFloat16) {
    rope_write_rows<c10::BFloat16>(qkv, cos, sin, k_cache, v_cache, sp, q_out, num_heads, num_kv_heads);
  } else {
    rope_write_rows<float>(qkv, cos, sin, k_cache, v_cache, sp, q_out, num_heads, num_kv_heads);
  }
  return q_out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_float(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul: gate_up [tokens, 2 * intermediate]");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor out = new_tensor({rows, n}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gp + r * 2 * n;
      const float* u = g + n;
      float* o = op + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.f + std::exp(std::min(-g[i], 80.f))) * u[i];
    }
  });
  return out;
}

}  // namespace tritonllm
