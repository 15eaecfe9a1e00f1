// Every op of the CPU kernels, with its schema: torch.ops.tritonllm.* (kernels.py calls them). The
// functions are in ops.h; ops without tensors get a catch-all kernel, the rest a CPU one.

#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(tritonllm, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor row_seq, "
        "Tensor row_end, Tensor row_start, float scale) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope_write_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping, int num_heads, int num_kv_heads) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("greedy_head(Tensor logits, bool logprobs=True) -> (Tensor, Tensor)");
  m.def("packed_gemm_supported() -> bool", &tritonllm::packed_gemm_supported);
  m.def("pack_gemm_weight(Tensor weight) -> Tensor");
  m.def("packed_gemm(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("packed_gemm_bf16_supported() -> bool", &tritonllm::packed_gemm_bf16_supported);
  m.def("pack_gemm_weight_bf16(Tensor weight) -> Tensor");
  m.def("packed_gemm_bf16(Tensor x, Tensor packed, Tensor? bias, int out_features, int in_features) -> Tensor");
  m.def("find_exact_blocks(Tensor weight, int levels) -> (Tensor, Tensor, Tensor)");
  m.def("pack_block_weight(Tensor q, Tensor? d, Tensor? m) -> (Tensor, Tensor)");
  m.def("block_gemm(Tensor x, Tensor codes, Tensor scales, Tensor? bias, int out_features) -> Tensor");
  m.def("screened_greedy_head(Tensor x, Tensor approx, Tensor weight, Tensor col_bounds) -> (Tensor, Tensor)");
  m.def("int8_screen_supported() -> bool", &tritonllm::int8_screen_supported);
  m.def("int8_screen_instructions() -> str", &tritonllm::int8_screen_instructions);
  m.def("int8_greedy_screen(Tensor x, Tensor codes, Tensor d, Tensor negq, Tensor c, Tensor weight, int steps)"
        " -> (Tensor, Tensor)");
  m.def("lora_delta_(Tensor(a!) y, Tensor x, Tensor?[] a, Tensor?[] b, Tensor?[] parts, int[] segments) -> Tensor(a!)");
  m.def("decoder_stack(Tensor(c!) hidden, Tensor[] norms, Tensor[] weights, Tensor?[] scales, Tensor?[] biases, "
        "int[] out_features, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor cos, Tensor sin, "
        "Tensor slot_mapping, Tensor block_table, Tensor row_seq, Tensor row_end, Tensor row_start, "
        "Tensor[] qk_norms, bool whole_projection_norms, Tensor[] output_norms, float scale, float eps, int num_heads, "
        "int num_kv_heads, Tensor? lora_table, int lora_slots, int[] lora_segments) "
        "-> Tensor(c!)");
  m.def("shm_all_reduce_segment_bytes(int world_size, int slot_bytes) -> int",
        &tritonllm::shm_all_reduce_segment_bytes);
  m.def("shm_all_reduce_init(Tensor(a!) segment, int world_size, int slot_bytes) -> ()");
  m.def("shm_all_reduce_join(Tensor(a!) segment, int rank, int pid) -> int");
  m.def("shm_all_reduce_joined(Tensor segment) -> int");
  m.def("shm_all_reduce_abort(Tensor(a!) segment) -> ()");
  m.def("shm_all_reduce_(Tensor(a!) x, Tensor(b!) segment, int rank, float timeout_s) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(tritonllm, CPU, m) {
  m.impl("paged_decode_attention", &tritonllm::paged_decode_attention);
  m.impl("add_rms_norm_", &tritonllm::add_rms_norm_);
  m.impl("rope_write_kv", &tritonllm::rope_write_kv);
  m.impl("silu_mul", &tritonllm::silu_mul);
  m.impl("greedy_head", &tritonllm::greedy_head);
  m.impl("pack_gemm_weight", &tritonllm::pack_gemm_weight);
  m.impl("packed_gemm", &tritonllm::packed_gemm);
  m.impl("pack_gemm_weight_bf16", &tritonllm::pack_gemm_weight_bf16);
  m.impl("packed_gemm_bf16", &tritonllm::packed_gemm_bf16);
  m.impl("find_exact_blocks", &tritonllm::find_exact_blocks);
  m.impl("pack_block_weight", &tritonllm::pack_block_weight);
  m.impl("block_gemm", &tritonllm::block_gemm);
  m.impl("screened_greedy_head", &tritonllm::screened_greedy_head);
  m.impl("int8_greedy_screen", &tritonllm::int8_greedy_screen);
  m.impl("lora_delta_", &tritonllm::lora_delta_);
  m.impl("decoder_stack", &tritonllm::decoder_stack);
  m.impl("shm_all_reduce_init", &tritonllm::shm_all_reduce_init);
  m.impl("shm_all_reduce_join", &tritonllm::shm_all_reduce_join);
  m.impl("shm_all_reduce_joined", &tritonllm::shm_all_reduce_joined);
  m.impl("shm_all_reduce_abort", &tritonllm::shm_all_reduce_abort);
  m.impl("shm_all_reduce_", &tritonllm::shm_all_reduce_);
}
