// The kernels' output and scratch tensors: new contiguous CPU tensors from <ATen/EmptyTensor.h> alone.
//
// Why not at::empty / at::zeros / at::empty_like: their headers (<ATen/ops/empty.h> and the like) bring
// ATen's context and operator declarations, which take about half of a small source's compile time, paid
// for each source and each instruction-set variant at install (kernels.py). The kernels only ever need
// contiguous CPU tensors, which at::detail::empty_cpu allocates directly.
#pragma once

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>

#include <cstring>

namespace tritonllm {

// Uninitialised, contiguous, on the CPU, with the options' dtype.
inline at::Tensor new_tensor(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return at::Tensor(at::detail::empty_cpu(sizes, options));
}

// As new_tensor, every byte zero (0 and 0.0 for every dtype the kernels use).
inline at::Tensor new_zeroed_tensor(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = new_tensor(sizes, options);
  std::memset(t.data_ptr(), 0, t.nbytes());
  return t;
}

}  // namespace tritonllm
