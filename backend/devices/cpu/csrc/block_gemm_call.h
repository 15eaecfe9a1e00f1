// One call of a GEMM on pack_block_weight's exact blocks (block_gemm): its inputs checked, x as rows,
// y allocated, and the result shaped like x.
#pragma once

#include <ATen/core/Tensor.h>

#include "cpu_tensors.h"

#include <cstdint>
#include <string>
#include <vector>

namespace tritonllm {

struct BlockGemmCall {
  enum class Format { kQ4, kQ8, kBf16 };  // 4-bit codes + d + m, 8-bit codes + d, bfloat16 values

  static constexpr int64_t kPanel = 32, kBlock = 32;

  at::Tensor x, y;  // [m, k] contiguous float32; [m, n]
  int64_t m = 0, k = 0, n = 0, panels = 0;
  Format format = Format::kQ4;
  const uint8_t* codes = nullptr;
  const float* scales = nullptr;  // null for bfloat16 values (no scales), never read then
  const float* bias = nullptr;    // null: no bias
  at::Tensor bias_holder;
  std::vector<int64_t> out_shape;

  // `name` prefixes the error messages (the op's own name).
  BlockGemmCall(const char* name, const at::Tensor& x_in, const at::Tensor& codes_t, const at::Tensor& scales_t,
                const c10::optional<at::Tensor>& bias_in, int64_t out_features) {
    const int64_t code_bytes = codes_t.dim() == 3 ? codes_t.size(2) : -1;
    TORCH_CHECK(codes_t.scalar_type() == at::kByte && codes_t.dim() == 3 && codes_t.is_contiguous() &&
                    (code_bytes == kPanel / 2 || code_bytes == kPanel || code_bytes == 2 * kPanel) &&
                    scales_t.scalar_type() == at::kFloat && scales_t.dim() == 4 && scales_t.is_contiguous() &&
                    scales_t.size(0) == codes_t.size(0) && scales_t.size(1) * kBlock == codes_t.size(1) &&
                    scales_t.size(2) == (code_bytes == kPanel / 2 ? 2 : code_bytes == kPanel ? 1 : 0) &&
                    scales_t.size(3) == kPanel,
                name, ": weight from pack_block_weight");
    format = code_bytes == kPanel / 2 ? Format::kQ4 : code_bytes == kPanel ? Format::kQ8 : Format::kBf16;
    k = codes_t.size(1), n = out_features, panels = codes_t.size(0);
    TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() >= 1 && x_in.size(-1) == k,
                name, ": float32 x with in_features ", k, " last");
    TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, name, ": out_features ", n,
                " does not match the packed weight");
    if (bias_in.has_value() && bias_in->defined()) {
      TORCH_CHECK(bias_in->scalar_type() == at::kFloat && bias_in->numel() == n, name, ": bias [out_features] float32");
      bias_holder = bias_in->contiguous();
      bias = bias_holder.data_ptr<float>();
    }
    x = x_in.reshape({-1, k}).contiguous();
    m = x.size(0);
    y = new_tensor({m, n}, x.options());
    codes = codes_t.data_ptr<uint8_t>();
    scales = scales_t.data_ptr<float>();
    out_shape.assign(x_in.sizes().begin(), x_in.sizes().end());
    out_shape.back() = n;
  }

  // run(Q4{}), run(Q8{}) or run(Bf16{}) by the weight's format: a kernel's three instantiations.
  template <typename Q4, typename Q8, typename Bf16, typename Run>
  void by_format(const Run& run) const {
    if (format == Format::kQ4) run(Q4{});
    else if (format == Format::kQ8) run(Q8{});
    else run(Bf16{});
  }

  // y in x's shape, out_features last.
  at::Tensor result() const { return y.view(out_shape); }
};

}  // namespace tritonllm
