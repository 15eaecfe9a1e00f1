// All decoder layers of a Llama-family model in one call, for a step on CPU in float32 whose attention
// runs through paged_decode_attention (devices/cpu/fused_layers.py `kernel_attention`).
//
// Why: at a few rows a layer's nine ops take microseconds each, and calling each from Python costs
// more than that (argument parsing, dispatch, output allocation) plus the modules around them, while
// the OpenMP worker waits between the parallel regions. Here each op is called through torch's
// dispatcher from C++ instead.
//
// Exactness: the same ops, on the same tensors, in the same order as models/llama.py's
// LlamaDecoderLayer with the CPU backend's fused modules (the first layer's norm is aten's rms_norm,
// the others are add_rms_norm_), so the results are that path's bit for bit. Each linear is given as
// what devices/cpu/packed_linear.py's PackedWeight would read at this row count: a packed_gemm panel
// weight, or the exact blocks (codes with their scales) for block_gemm.

#include <ATen/ops/rms_norm.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/List.h>

#include "ops.h"

#include <vector>

#include "lora_delta.h"

namespace {

constexpr int64_t kLinearsPerLayer = 4;  // fused QKV, output, fused gate/up, down

template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using Gemm = at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, int64_t);
using BlockGemm = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                             int64_t);
using AddNorm = at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using RopeWrite = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                             const at::Tensor&, int64_t, int64_t);
using Attention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using SiluMul = at::Tensor(const at::Tensor&);

struct Ops {
  c10::TypedOperatorHandle<Gemm> packed_gemm = op<Gemm>("tritonllm::packed_gemm");
  c10::TypedOperatorHandle<BlockGemm> block_gemm = op<BlockGemm>("tritonllm::block_gemm");
  c10::TypedOperatorHandle<AddNorm> add_rms_norm = op<AddNorm>("tritonllm::add_rms_norm_");
  c10::TypedOperatorHandle<RopeWrite> rope_write_kv = op<RopeWrite>("tritonllm::rope_write_kv");
  c10::TypedOperatorHandle<Attention> attention = op<Attention>("tritonllm::paged_decode_attention");
  c10::TypedOperatorHandle<SiluMul> silu_mul = op<SiluMul>("tritonllm::silu_mul");
};

const Ops& ops() {
  static const Ops instance;  // looked up once: the other files' ops are registered by then
  return instance;
}

}  // namespace

namespace tritonllm {

// hidden [tokens, hidden_size]: the embeddings, which become the residual stream (updated in place).
// Per layer l: norms[2l], norms[2l + 1] (input and post-attention RMSNorm weights; empty for OLMo,
// which norms neither: the attention and the MLP then read the residual stream itself); weights[4l + i]
// with scales[4l + i] (i: QKV, O, gate/up, down): a packed_gemm weight where the scale is None, else
// block_gemm codes; biases likewise (None: no bias). qk_norms: empty, or per layer the query and key
// RMSNorm weights, over each head (Qwen3) or, with whole_projection_norms, over all the query and all the
// key heads at once (OLMo), written back into the fused projection before the rotary. output_norms:
// empty, or per layer the norms of the attention's and the MLP's outputs before their residual adds
// (OLMo's post_attention_ and post_feedforward_layernorm). Attention: one paged_decode_attention call per
// layer over all the step's rows, with the step's block_table and per row row_seq, row_end, row_start
// (devices/cpu/attention_rows.py; the same for every layer). Returns the final residual stream (before
// the final norm), as LlamaForCausalLM.forward does. LoRA (layers/lora.py): lora_table holds lora_slots rows per
// linear (lora_delta.h add_delta_from_table: each slot's adapter weights by address), and lora_segments
// the step's (slot, first row, end row) runs; each linear's output gets its rows' deltas right after its
// GEMM, as Linear.forward adds them. Empty lists: a step of base-model rows only.
at::Tensor decoder_stack(const at::Tensor& hidden_in, at::TensorList norms, at::TensorList weights,
                         const c10::List<c10::optional<at::Tensor>>& scales,
                         const c10::List<c10::optional<at::Tensor>>& biases, at::IntArrayRef out_features,
                         at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& slot_mapping, const at::Tensor& block_table, const at::Tensor& row_seq,
                         const at::Tensor& row_end, const at::Tensor& row_start, at::TensorList qk_norms,
                         bool whole_projection_norms, at::TensorList output_norms, double scale, double eps,
                         int64_t num_heads, int64_t num_kv_heads, const c10::optional<at::Tensor>& lora_table,
                         int64_t lora_slots, at::IntArrayRef lora_segments) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  const int64_t linears = kLinearsPerLayer * layers;
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(v_caches.size()) == layers &&
                  (norms.empty() || static_cast<int64_t>(norms.size()) == 2 * layers) &&
                  static_cast<int64_t>(weights.size()) == linears &&
                  static_cast<int64_t>(scales.size()) == linears && static_cast<int64_t>(biases.size()) == linears &&
                  static_cast<int64_t>(out_features.size()) == linears,
              "decoder_stack: per layer 2 norms or none, 4 weights (with scales, biases, out_features) and one K and "
              "V cache");
  TORCH_CHECK(qk_norms.empty() || static_cast<int64_t>(qk_norms.size()) == 2 * layers,
              "decoder_stack: no query/key norms, or a query and a key norm per layer");
  TORCH_CHECK(output_norms.empty() || static_cast<int64_t>(output_norms.size()) == 2 * layers,
              "decoder_stack: no output norms, or an attention and an MLP output norm per layer");
  const bool lora = !lora_segments.empty();
  TORCH_CHECK(!lora || (lora_slots > 0 && lora_table.has_value() && lora_table->scalar_type() == at::kLong &&
                        lora_table->is_contiguous() && lora_table->numel() == linears * lora_slots * 5),
              "decoder_stack: LoRA's table holds lora_slots rows of 5 int64 per linear");
  const int64_t* table = lora ? lora_table->data_ptr<int64_t>() : nullptr;
  TORCH_CHECK(hidden_in.dim() == 2 && hidden_in.scalar_type() == at::kFloat, "decoder_stack: hidden [tokens, hidden] float32");
  const Ops& o = ops();
  const int64_t tokens = hidden_in.size(0), head_dim = k_caches[0].size(3);
  auto linear = [&](const at::Tensor& x, int64_t i) {
    const c10::optional<at::Tensor> s = scales.get(i), bias = biases.get(i);
    at::Tensor y = s.has_value() && s->defined() ? o.block_gemm.call(x, weights[i], *s, bias, out_features[i])
                                                 : o.packed_gemm.call(x, weights[i], bias, out_features[i]);
    if (lora) tritonllm::lora::add_delta_from_table(y, x, table + 5 * lora_slots * i, lora_slots, lora_segments);
    return y;
  };
  auto attention = [&](const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache) {
    return o.attention.call(q, k_cache, v_cache, block_table, row_seq, row_end, row_start, scale);
  };
  const int64_t width = hidden_in.size(1);
  // residual += x, then the norm of it (LlamaDecoderLayer's _add_and_norm): the stream itself without one.
  auto add_and_norm = [&](at::Tensor& residual, const at::Tensor& x, int64_t norm) {
    return norms.empty() ? residual.add_(x) : o.add_rms_norm.call(residual, x, norms[norm], eps);
  };
  // As LlamaAttention: each head normed (Qwen3), or the query's and the key's heads together in float32
  // (OLMo's _projection_norm), written back in place.
  auto norm_heads = [&](at::Tensor heads, const at::Tensor& weight) {
    if (!whole_projection_norms) {
      heads.copy_(at::rms_norm(heads, {head_dim}, weight, eps));
      return;
    }
    at::Tensor flat = heads.reshape({tokens, -1}).to(at::kFloat);
    at::Tensor sum_sq = flat.pow(2).sum(-1, true);
    heads.copy_((weight * (flat * at::rsqrt(sum_sq / flat.size(1) + eps))).to(heads.scalar_type()).view_as(heads));
  };
  at::Tensor residual = hidden_in, hidden;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t i = kLinearsPerLayer * l;
    at::Tensor x = l > 0 ? add_and_norm(residual, hidden, 2 * l)
                   : norms.empty() ? residual : at::rms_norm(residual, {width}, norms[0], eps);
    at::Tensor qkv = linear(x, i).view({tokens, num_heads + 2 * num_kv_heads, head_dim});
    if (!qk_norms.empty()) {
      norm_heads(qkv.narrow(1, 0, num_heads), qk_norms[2 * l]);
      norm_heads(qkv.narrow(1, num_heads, num_kv_heads), qk_norms[2 * l + 1]);
    }
    at::Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    at::Tensor q = o.rope_write_kv.call(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads);
    at::Tensor out = linear(attention(q, k_cache, v_cache).view({tokens, num_heads * head_dim}), i + 1);
    if (!output_norms.empty()) out = at::rms_norm(out, {width}, output_norms[2 * l], eps);
    x = add_and_norm(residual, out, 2 * l + 1);
    hidden = linear(o.silu_mul.call(linear(x, i + 2)), i + 3);
    if (!output_norms.empty()) hidden = at::rms_norm(hidden, {width}, output_norms[2 * l + 1], eps);
  }
  return residual.add_(hidden);
}

}  // namespace tritonllm
