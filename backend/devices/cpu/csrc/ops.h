// The C++ functions behind torch.ops.tritonllm.*: each is defined in its kernel's own source and
// registered, with its schema, in registration.cpp.
//
// Why the split: torch's registration header (<torch/library.h>) and <ATen/ATen.h> take most of a
// source's compile time, and every source is compiled once per instruction-set variant at install
// (kernels.py). The kernels need only the Tensor type, the thread pool and a few allocating ops, so
// they include those alone, and one source pays for the registration. c10::List is only declared here
// (ATen_fwd.h): the two kernels that take one include its definition.
#pragma once

#include <ATen/core/ATen_fwd.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <tuple>

namespace tritonllm {

// paged_decode_attention.cpp
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_table, const at::Tensor& row_seq, const at::Tensor& row_end,
                                  const at::Tensor& row_start, double scale);

// fused_decoder_ops.cpp
at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                         at::Tensor& v_cache, const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads);
at::Tensor silu_mul(const at::Tensor& gate_up);

// greedy_head.cpp
std::tuple<at::Tensor, at::Tensor> greedy_head(const at::Tensor& logits, bool logprobs_wanted);

// packed_gemm.cpp
bool packed_gemm_supported();
bool packed_gemm_bf16_supported();
at::Tensor pack_gemm_weight(const at::Tensor& weight);
at::Tensor packed_gemm(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t out_features);
at::Tensor pack_gemm_weight_bf16(const at::Tensor& weight);
at::Tensor packed_gemm_bf16(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                            int64_t out_features, int64_t in_features);

// exact_block_gemm.cpp
std::tuple<at::Tensor, at::Tensor> pack_block_weight(const at::Tensor& q, const c10::optional<at::Tensor>& d,
                                                     const c10::optional<at::Tensor>& m);
at::Tensor block_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& bias, int64_t out_features);

// find_exact_blocks.cpp
std::tuple<at::Tensor, at::Tensor, at::Tensor> find_exact_blocks(const at::Tensor& weight, int64_t levels);

// screened_greedy_head.cpp
std::tuple<at::Tensor, at::Tensor> screened_greedy_head(const at::Tensor& x, const at::Tensor& approx,
                                                        const at::Tensor& weight, const at::Tensor& col_bounds);

// int8_greedy_screen.cpp
bool int8_screen_supported();
std::string int8_screen_instructions();
std::tuple<at::Tensor, at::Tensor> int8_greedy_screen(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                                                      const at::Tensor& negq, const at::Tensor& c,
                                                      const at::Tensor& weight, int64_t steps);

// lora_delta.cpp
at::Tensor lora_delta_(at::Tensor& y, const at::Tensor& x, const c10::List<c10::optional<at::Tensor>>& a,
                       const c10::List<c10::optional<at::Tensor>>& b, const c10::List<c10::optional<at::Tensor>>& parts,
                       at::IntArrayRef segments);

// decoder_stack.cpp
at::Tensor decoder_stack(const at::Tensor& hidden, at::TensorList norms, at::TensorList weights,
                         const c10::List<c10::optional<at::Tensor>>& scales,
                         const c10::List<c10::optional<at::Tensor>>& biases, at::IntArrayRef out_features,
                         at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& slot_mapping, const at::Tensor& block_table, const at::Tensor& row_seq,
                         const at::Tensor& row_end, const at::Tensor& row_start, at::TensorList qk_norms,
                         bool whole_projection_norms, at::TensorList output_norms, double scale, double eps,
                         int64_t num_heads, int64_t num_kv_heads, const c10::optional<at::Tensor>& lora_table,
                         int64_t lora_slots, at::IntArrayRef lora_segments);

// shared_memory_all_reduce.cpp
int64_t shm_all_reduce_segment_bytes(int64_t world_size, int64_t slot_bytes);
void shm_all_reduce_init(const at::Tensor& segment, int64_t world_size, int64_t slot_bytes);
int64_t shm_all_reduce_join(const at::Tensor& segment, int64_t rank, int64_t pid);
int64_t shm_all_reduce_joined(const at::Tensor& segment);
void shm_all_reduce_abort(const at::Tensor& segment);
at::Tensor& shm_all_reduce_(at::Tensor& x, const at::Tensor& segment, int64_t rank, double timeout_s);

}  // namespace tritonllm
