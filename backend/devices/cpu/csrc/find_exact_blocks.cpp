// Finding a float32 weight's exact Q4_1 or Q8_0 blocks at load: devices/cpu/exact_blocks.py's search
// (its docstring gives the forms and the scale candidates) in one pass over the weight, each thread
// on its own rows, a block at a time in registers and L1, where the torch version makes a dozen passes
// over weight-sized temporaries.
//
// A block is taken only where the codes and scale found give back every one of its 32 values bit for
// bit as the block GEMM decodes them (exact_block_gemm.cpp): Q4_1 in one FMA, round(d * q + m), taken
// only where every d * q is exact, so that it is also fl(fl(d * q) + m); Q8_0 as fl(d * q). One block
// that is neither rejects the whole weight, which then stays float32 only. The checks compare bits
// and count bits in integers: the kernels build with -ffast-math, under which the compiler may take
// every float for finite, every zero for +0.0 and a float expression for its value in real numbers.

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include "cpu_tensors.h"
#include "ops.h"

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

constexpr int64_t kBlock = 32;

uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

bool negative(float x) { return bits_of(x) >> 31; }
bool usable_scale(float c) { return !negative(c) && bits_of(c) != 0 && (bits_of(c) & 0x7f800000u) != 0x7f800000u; }

// Whether fl(c * code) == c * code, for c > 0 finite and code in 0..15, in integers: c's significand
// times the code must span at most float32's 24 bits.
bool product_exact(float c, uint32_t code) {
  const uint32_t b = bits_of(c);
  const uint64_t significand = (b & 0x7fffffu) | ((b >> 23) & 0xffu ? 0x800000u : 0u);
  const uint64_t product = significand * code;
  return product == 0 || 64 - __builtin_clzll(product) - __builtin_ctzll(product) <= 24;
}

// a / b rounded as IEEE division: under -ffast-math a division by a constant becomes a multiply by
// its rounded reciprocal, which may differ in the last bit, and the quotient is a scale candidate.
__attribute__((noinline, optimize("no-reciprocal-math"))) float divided(float a, float b) { return a / b; }

// The scale candidates, in exact_blocks.py's order: span / levels rounded to float16, that value's
// float16 neighbours one and two steps away, then the float32 quotient itself.
void scale_candidates(float span, float levels, float out[6]) {
  const float quotient = divided(span, levels);
  const uint16_t half = c10::Half(quotient).x;
  const int steps[5] = {0, 1, -1, 2, -2};
  for (int i = 0; i < 5; ++i)
    out[i] = static_cast<float>(c10::Half(static_cast<uint16_t>(half + steps[i]), c10::Half::from_bits()));
  out[5] = quotient;
}

// Q4_1: w = round(d * q + m), q in 0..15, m the block's least value, every d * q exact (a float16 d's
// always are: 11 significant bits times 4). False if no candidate gives back every value.
bool solve_q4_1(const float* w, uint8_t* q, float* d_out, float* m_out) {
  float lo = w[0], hi = w[0];
  for (int64_t i = 1; i < kBlock; ++i) {
    lo = w[i] < lo ? w[i] : lo;
    hi = w[i] > hi ? w[i] : hi;
  }
  *m_out = lo;
  const float span = hi - lo;
  if (span == 0) {  // one repeated value: q = 0 and d = 0, or -0.0 where m is negative (-0.0 + -0.0 is -0.0)
    const float d = negative(lo) ? -0.0f : 0.0f;
    uint32_t diff = 0;
    for (int64_t i = 0; i < kBlock; ++i) diff |= bits_of(std::fma(d, 0.0f, lo)) ^ bits_of(w[i]);
    std::memset(q, 0, kBlock);
    *d_out = d;
    return diff == 0;
  }
  float candidates[6];
  scale_candidates(span, 15.0f, candidates);
  for (int j = 0; j < 6; ++j) {
    const float c = candidates[j];
    if (!usable_scale(c)) continue;
    float codes[kBlock];
    uint32_t diff = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      codes[i] = std::nearbyint(std::fmin(std::fmax((w[i] - lo) / c, 0.0f), 15.0f));
      diff |= bits_of(std::fma(c, codes[i], lo)) ^ bits_of(w[i]);
    }
    if (diff == 0 && j == 5) {  // the float32 quotient: its products need not be exact
      for (int64_t i = 0; i < kBlock; ++i) diff |= !product_exact(c, static_cast<uint32_t>(codes[i]));
    }
    if (diff == 0) {
      for (int64_t i = 0; i < kBlock; ++i) q[i] = static_cast<uint8_t>(codes[i]);
      *d_out = c;
      return true;
    }
  }
  return false;
}

// Q8_0: w = fl(d * q), q in -128..127. A block of zeros: d = 0 and q = -1 where the zero is -0.0.
bool solve_q8_0(const float* w, int8_t* q, float* d_out) {
  float span = 0;
  for (int64_t i = 0; i < kBlock; ++i) span = std::fabs(w[i]) > span ? std::fabs(w[i]) : span;
  if (span == 0) {
    uint32_t diff = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      q[i] = negative(w[i]) ? -1 : 0;
      diff |= bits_of(w[i]) & 0x7fffffffu;
    }
    *d_out = 0.0f;
    return diff == 0;
  }
  float candidates[6];
  scale_candidates(span, 127.0f, candidates);
  for (const float c : candidates) {
    if (!usable_scale(c)) continue;
    int8_t codes[kBlock];
    uint32_t diff = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      codes[i] = static_cast<int8_t>(std::nearbyint(std::fmin(std::fmax(w[i] / c, -128.0f), 127.0f)));
      diff |= bits_of(c * static_cast<float>(codes[i])) ^ bits_of(w[i]);  // the integer code, as the GEMM gets it
    }
    if (diff == 0) {
      std::memcpy(q, codes, kBlock);
      *d_out = c;
      return true;
    }
  }
  return false;
}

}  // namespace

namespace tritonllm {

// weight [N, K] float32 (K a multiple of 32, every value finite) -> (q, d, m): levels 15 gives Q4_1
// (q uint8 [N, K], d and m float32 [N, K / 32]), levels 127 gives Q8_0 (q int8, d, and m empty).
// Where some block is not of that form, q is empty.
std::tuple<at::Tensor, at::Tensor, at::Tensor> find_exact_blocks(const at::Tensor& weight_in, int64_t levels) {
  TORCH_CHECK(weight_in.dim() == 2 && weight_in.scalar_type() == at::kFloat && weight_in.size(1) % kBlock == 0,
              "find_exact_blocks: weight must be float32 [out, in] with in a multiple of 32");
  TORCH_CHECK(levels == 15 || levels == 127, "find_exact_blocks: levels must be 15 (Q4_1) or 127 (Q8_0)");
  const at::Tensor weight = weight_in.contiguous();
  const bool q4 = levels == 15;
  const int64_t n = weight.size(0), k = weight.size(1), blocks = k / kBlock;
  const auto floats = weight.options();
  at::Tensor q = new_tensor({n, k}, floats.dtype(q4 ? at::kByte : at::kChar));
  at::Tensor d = new_tensor({n, blocks}, floats);
  at::Tensor m = q4 ? new_tensor({n, blocks}, floats) : new_tensor({0}, floats);
  const float* ws = weight.data_ptr<float>();
  uint8_t* qs = reinterpret_cast<uint8_t*>(q.data_ptr());
  float* ds = d.data_ptr<float>();
  float* ms = q4 ? m.data_ptr<float>() : nullptr;
  std::atomic<bool> found{true};
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1 && found.load(std::memory_order_relaxed); ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t at = r * k + b * kBlock, scale = r * blocks + b;
        const bool ok = q4 ? solve_q4_1(ws + at, qs + at, ds + scale, ms + scale)
                           : solve_q8_0(ws + at, reinterpret_cast<int8_t*>(qs) + at, ds + scale);
        if (!ok) {
          found.store(false, std::memory_order_relaxed);
          break;
        }
      }
  });
  if (!found.load()) q = new_tensor({0}, q.options());
  return {q, d, m};
}

}  // namespace tritonllm
