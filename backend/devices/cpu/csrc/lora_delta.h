// Multi-LoRA deltas on the CPU (lora_delta.cpp): what the op `lora_delta_` and the decoder stack share.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace tritonllm::lora {

// One adapter's weights for one linear, as layers/lora.py's LoraWeights holds them: `a` [ranks, in]
// (the fused parts' A matrices stacked), `b` [ranks, out] (each part's B transposed, scaling folded
// in), and per part its (first, end) rank row and (first, end) output column. `a` null: this adapter
// leaves the linear alone.
struct Adapter {
  const float* a = nullptr;
  const float* b = nullptr;
  int64_t ranks = 0;
  const int64_t* parts = nullptr;  // num_parts x 4; none: one part, every rank row to every column
  int64_t num_parts = 0;
};

// y[rows] += (x[rows] A^T) B over each segment (slot, first row, end row) whose slot holds an adapter.
// x [rows, in] and y [rows, out], float32, rows `x_stride` / `y_stride` floats apart; `slots` has
// `num_slots` entries, `segments` 3 x `num_segments` numbers.
void add_delta(float* y, int64_t y_stride, const float* x, int64_t x_stride, int64_t in, int64_t out,
               const Adapter* slots, int64_t num_slots, const int64_t* segments, int64_t num_segments);

// add_delta for one linear whose slots are given as rows of a table, `num_slots` rows of five int64:
// the addresses of A, B and the parts (0 for none) with the ranks and the part count (A's address 0:
// no adapter). The decoder stack's form: the caller built the table from live tensors whose shapes it
// checked, and keeps them alive.
void add_delta_from_table(at::Tensor& y, const at::Tensor& x, const int64_t* table, int64_t num_slots,
                          at::IntArrayRef segments);

}  // namespace tritonllm::lora
