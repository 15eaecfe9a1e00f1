// Our float32 GEMM on weights kept as the quantized blocks they exactly are: y = x @ W^T + bias with
// W's float32 values decoded in registers, the same values packed_gemm.cpp would read.
//
// Why: a model converted from a GGUF file holds float32 weights that are, bit for bit, what its
// quantized blocks dequantise to: per block of 32 values along K, fl(fl(d * q) + m) with q in 0..15
// (Q4_1) or fl(d * q) with q in -128..127 (Q8_0); a bfloat16 checkpoint loaded as float32 holds bfloat16
// values. Kept as those blocks, a panel takes a fifth (Q4_1), under a third (Q8_0) or half (bfloat16)
// of its float32 bytes. A step of a few rows is bound by streaming the weights, so it runs faster from
// the blocks (devices/cpu/exact_blocks.py finds them at load and checks every value;
// devices/cpu/packed_linear.py picks them by row count).
//
// Exactness: the microkernel decodes a k step's 32 weights to the float32 values the weight holds,
// then does what packed_gemm's microkernel does: start from zero (or the bias) and add one FMA per
// product in k order. So each result equals packed_gemm's bit for bit, whatever the batch or the
// tiling. Q4_1 decodes in one FMA, round(d * q + m): pack_block_weight accepts only d whose products
// d * q are exact in float32 (every float16 d is: 11 significant bits times 4), and then that one
// rounding is fl(fl(d * q) + m). Q8_0 decodes as fl(d * q), with an explicit-rounding multiply that
// the compiler cannot fuse with anything.
//
// The same source builds for AVX-512 and AVX2 + FMA (panel_vectors.h); on either, the results equal
// packed_gemm's on that build, and the two builds give the same bits. On AVX2 (16 registers) one or
// two rows take a whole panel, broadcasting their x first and decoding one vector of 8 columns at a
// time straight into their FMAs; 3 to 5 rows take it in halves of 16 columns (row_block). The sums
// are the same chains in the same order.
//
// Layout per 32-column panel (the last one zero-padded; zero codes and scales decode to 0.0):
//   Q4_1: codes [K, 16] uint8, byte j of a k step = column j (low nibble) | column j + 16 (high);
//         scales [K / 32, 2, 32] float32, a block's d for the 32 columns, then its m.
//   Q8_0: codes [K, 32] int8; scales [K / 32, 32] float32, a block's d.
//   bfloat16: codes [K, 32] bfloat16 (64 bytes a k step); scales [K / 32, 0, 32] (none).

#include <ATen/Parallel.h>

#include "cpu_tensors.h"
#include "ops.h"

#include "block_gemm_call.h"
#include "claimed_chunks.h"
#include "panel_vectors.h"
#include "row_blocks.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <array>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kPanel = 32;           // output columns per panel (two zmm, four ymm)
constexpr int64_t kBlock = 32;           // k values sharing one scale (and one min)
#if TRITONLLM_PANEL_GEMM && !defined(__AVX512F__)
constexpr int kMaxRows = 5;              // rows per row block on AVX2 (row_block: 10 accumulators at most)
constexpr int kSplitRows = 3;            // rows per row block where a call's rows need several (run_panels)
#else
constexpr int kMaxRows = 12;             // rows per microkernel call
constexpr int kSplitRows = kMaxRows;
#endif
constexpr int64_t kClaimsPerThread = 8;  // panel runs each thread claims (claimed_chunks.h)
// The first row block of a panel pulls its codes (and scales) this far ahead into L1, so codes coming
// from DRAM arrive before the FMAs need them (the distances tried are in docs/HISTORY.md).
constexpr int64_t kPrefetchBytes = 2048;

// Whether fl(d * q) == d * q for every 4-bit code q [N, K] and its block's d [N, K / 32].
bool products_exact(const at::Tensor& q, const at::Tensor& d) {
  const int64_t n = q.size(0), k = q.size(1), blocks = k / kBlock;
  const uint8_t* qs = q.data_ptr<uint8_t>();
  const float* ds = d.data_ptr<float>();
  std::atomic<bool> exact{true};
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1 && exact.load(std::memory_order_relaxed); ++r)
      for (int64_t i = 0; i < k; ++i) {
        const float dv = ds[r * blocks + i / kBlock];
        const float qv = static_cast<float>(qs[r * k + i]);
        const float rounded = dv * qv;  // float32: no FMA contraction here, nothing is added
        if (static_cast<double>(rounded) != static_cast<double>(dv) * static_cast<double>(qv)) {
          exact.store(false, std::memory_order_relaxed);
          break;
        }
      }
  });
  return exact.load();
}

}  // namespace

namespace tritonllm {

// (codes, scales) for W [N, K] given as q [N, K] and d, m [N, K / 32] float32: uint8 q (0..15) with d
// and m (Q4_1), int8 q with d (Q8_0), or bfloat16 q, the values themselves, with neither (bfloat16).
std::tuple<at::Tensor, at::Tensor> pack_block_weight(const at::Tensor& q_in, const c10::optional<at::Tensor>& d_in,
                                                     const c10::optional<at::Tensor>& m_in) {
  const bool has_d = d_in.has_value() && d_in->defined(), has_m = m_in.has_value() && m_in->defined();
  const auto type = q_in.scalar_type();
  const bool q4 = type == at::kByte, bf16 = type == at::kBFloat16;
  TORCH_CHECK(q_in.dim() == 2 && ((q4 && has_d && has_m) || (type == at::kChar && has_d && !has_m) ||
                                  (bf16 && !has_d && !has_m)),
              "pack_block_weight: q [out, in]: uint8 with d and m, int8 with d, or bfloat16 alone");
  const int64_t n = q_in.size(0), k = q_in.size(1), blocks = k / kBlock, panels = (n + kPanel - 1) / kPanel;
  TORCH_CHECK(k % kBlock == 0, "pack_block_weight: in_features must be a multiple of 32");
  TORCH_CHECK(!has_d || (d_in->scalar_type() == at::kFloat && d_in->dim() == 2 && d_in->size(0) == n &&
                         d_in->size(1) == blocks && (!has_m || (m_in->scalar_type() == at::kFloat &&
                                                                m_in->sizes() == d_in->sizes()))),
              "pack_block_weight: d (and m) float32 [out, in / 32]");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor d = has_d ? d_in->contiguous() : at::Tensor(), m = has_m ? m_in->contiguous() : at::Tensor();
  if (q4) {
    TORCH_CHECK(q.numel() == 0 || q.max().item<uint8_t>() < 16, "pack_block_weight: 4-bit q must be 0..15");
    TORCH_CHECK(products_exact(q, d), "pack_block_weight: 4-bit blocks need every d * q exact in float32 ",
                "(true for float16 d): the GEMM decodes them with one rounding");
  }
  const int64_t elem = q.element_size();  // bytes per value: 1, or 2 for bfloat16
  const int64_t code_bytes = q4 ? kPanel / 2 : kPanel * elem, scale_rows = q4 ? 2 : (has_d ? 1 : 0);
  at::Tensor codes = new_zeroed_tensor({panels, k, code_bytes}, q.options().dtype(at::kByte));
  at::Tensor scales = new_zeroed_tensor({panels, blocks, scale_rows, kPanel}, q.options().dtype(at::kFloat));
  const uint8_t* qs = reinterpret_cast<const uint8_t*>(q.data_ptr());
  const float* ds = has_d ? d.data_ptr<float>() : nullptr;
  const float* ms = has_m ? m.data_ptr<float>() : nullptr;
  uint8_t* cp = codes.data_ptr<uint8_t>();
  float* sp = scales.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < kPanel && p * kPanel + j < n; ++j) {
        const int64_t col = p * kPanel + j;
        for (int64_t i = 0; i < k; ++i) {
          uint8_t* step = cp + (p * k + i) * code_bytes;
          if (q4) step[j % (kPanel / 2)] |= static_cast<uint8_t>(qs[col * k + i] << (j < kPanel / 2 ? 0 : 4));
          else std::memcpy(step + j * elem, qs + (col * k + i) * elem, elem);
        }
        for (int64_t b = 0; b < blocks && scale_rows > 0; ++b) {
          float* s = sp + (p * blocks + b) * scale_rows * kPanel + j;
          s[0] = ds[col * blocks + b];
          if (q4) s[kPanel] = ms[col * blocks + b];
        }
      }
  });
  return {codes, scales};
}

}  // namespace tritonllm

namespace {

#if TRITONLLM_PANEL_GEMM

namespace pv = tritonllm::panel;
using pv::vf;
using pv::vi;
constexpr int V = pv::kPanelVectors;     // vectors per k step of a panel
constexpr int kHalfVectors = 16 / pv::VL;  // vectors per 16 columns

// A format decodes one k step of a panel into the V vectors of its 32 float32 weights.
// Q4_1 blocks. kShiftNibbles: the low nibbles by two shifts rather than a 0xf mask, which would take a
// register of its own (row_block uses it where the 16 ymm are all taken).
template <bool kShiftNibbles>
struct Q4Format {
  static constexpr int64_t kCodeBytes = kPanel / 2, kScaleFloats = 2 * kPanel;
#if TRITONLLM_PANEL_VL == 16
  vf d_[V], m_[V];  // the block's d and m in registers: 32 zmm have room
  void block(const float* s) {
#pragma GCC unroll 4
    for (int j = 0; j < V; ++j) d_[j] = pv::load(s + j * pv::VL), m_[j] = pv::load(s + kPanel + j * pv::VL);
  }
  vf d(int j) const { return d_[j]; }
  vf m(int j) const { return m_[j]; }
#else
  // AVX2: m in registers, d read from L1 at each use (as an FMA's memory operand), so the 16 ymm still
  // hold the sums; holding d too spills them
  const float* d_;
  vf m_[V];
  void block(const float* s) {
    d_ = s;
#pragma GCC unroll 4
    for (int j = 0; j < V; ++j) m_[j] = pv::load(s + kPanel + j * pv::VL);
  }
  vf d(int j) const { return pv::load(d_ + j * pv::VL); }
  vf m(int j) const { return m_[j]; }
#endif
  // Vector j: columns 16 (j / H) + VL (j % H) .., bytes VL (j % H) .. (H = 16 / VL): low nibbles for the
  // first 16 columns, high for the next 16.
  vf decode(const uint8_t* c, int j) const {
    const vi v = pv::widen_u8(c + (j % kHalfVectors) * pv::VL);
    // d * q is exact (pack_block_weight checks), so one rounding is both
    const vi q = j >= kHalfVectors ? v >> 4 : kShiftNibbles ? (vi)((pv::vu32)(v << 28) >> 28) : v & 0xf;
    return pv::fma(pv::to_float(q), d(j), m(j));
  }
};

using Q4Blocks = Q4Format<false>;

struct Q8Blocks {
  static constexpr int64_t kCodeBytes = kPanel, kScaleFloats = kPanel;
  vf d[V];
  void block(const float* s) {
#pragma GCC unroll 4
    for (int j = 0; j < V; ++j) d[j] = pv::load(s + j * pv::VL);
  }
  vf decode(const uint8_t* c, int j) const { return pv::mul_rounded(pv::to_float(pv::widen_s8(c + j * pv::VL)), d[j]); }
};

// bfloat16 values (a bfloat16 checkpoint loaded as float32): widening is exact, so no rounding at all.
struct Bf16Values {
  static constexpr int64_t kCodeBytes = 2 * kPanel, kScaleFloats = 0;
  void block(const float*) {}
  vf decode(const uint8_t* c, int j) const { return pv::widen_bf16(c + j * 2 * pv::VL); }
};

// A panel some earlier row block already decoded (run_panels' `decoded`): its float32 weights, 32 a k step.
struct DecodedPanel {
  static constexpr int64_t kCodeBytes = kPanel * 4, kScaleFloats = 0;
  void block(const float*) {}
  vf decode(const uint8_t* c, int j) const { return pv::load(reinterpret_cast<const float*>(c) + j * pv::VL); }
};

// y[0..R) x [0..32 P) = x[0..R) . P consecutive full panels (+ bias), packed_gemm's arithmetic on
// decoded weights. Each output's sum is one chain of FMAs in k order, 4 cycles apart (the FMA's latency):
// a row block needs several chains in flight to keep the FMA pipes busy, which one row over one panel
// (V chains) may not have, so one row takes kOneRowPanels panels at once; every chain keeps its own k
// order, so the results stay the same bit for bit.
// `keep` (P = 1): also store each k step's decoded weights there ([k, 32] float32) for the panel's later
// row blocks. Panel q of the P starts at codes + q * code_stride and scales + q * scale_stride.
template <typename Format, int R, int P = 1, int J0 = 0, int J1 = V>
void microkernel(const float* x, int64_t ldx, const uint8_t* codes, const float* scales, int64_t k, float* y,
                 int64_t ldy, const float* bias, bool prefetch, float* keep) {
  constexpr int64_t kBlockBytes = kBlock * Format::kCodeBytes, kLineSteps = 64 / Format::kCodeBytes;
  constexpr int64_t kAhead = (kPrefetchBytes + kBlockBytes - 1) / kBlockBytes;  // in blocks
  const int64_t code_stride = k * Format::kCodeBytes, scale_stride = (k / kBlock) * Format::kScaleFloats;
  constexpr int W = J1 - J0;  // the panel's vectors J0 .. J1 - 1: all of it, or on AVX2 half of it (row_block)
  // Past its last block a stream's prefetches go on into the same stream of the next P panels, the
  // next microkernel call of a thread's own run (claimed_chunks.h); for P = 1 that is the next panel
  // itself, for P = 2 the stream jumps the group's other panel.
  const int64_t nblocks = k / kBlock;
  vf acc[P][R][W];
#pragma GCC unroll 4
  for (int q = 0; q < P; ++q)
#pragma GCC unroll 4
    for (int j = 0; j < W; ++j) {
      const vf init = bias ? pv::load(bias + q * kPanel + (J0 + j) * pv::VL) : pv::zero();
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) acc[q][r][j] = init;
    }
  Format format[P];
  for (int64_t blk = 0; blk < nblocks; ++blk) {
#pragma GCC unroll 4
    for (int q = 0; q < P; ++q) {
      const float* qs = scales + q * scale_stride;
      format[q].block(qs + blk * Format::kScaleFloats);
      if (prefetch)
        for (int64_t line = 0; line < Format::kScaleFloats * 4; line += 64)
          pv::prefetch(reinterpret_cast<const char*>(qs + (blk + kAhead) * Format::kScaleFloats +
                                                     (blk + kAhead >= nblocks ? (P - 1) * scale_stride : 0)) + line);
    }
    for (int64_t i = blk * kBlock; i < (blk + 1) * kBlock; ++i) {
#pragma GCC unroll 4
      for (int q = 0; q < P; ++q)
        if (prefetch && (i % kLineSteps) == 0)
          pv::prefetch(codes + q * code_stride + (blk + kAhead) * kBlockBytes + (i - blk * kBlock) * Format::kCodeBytes +
                       (blk + kAhead >= nblocks ? (P - 1) * code_stride : 0));
      if constexpr (W <= 2) {  // AVX-512, AVX2's half panels: the step's vectors decoded, then R rows' FMAs, one broadcast at a time
        vf b[P][W];
#pragma GCC unroll 4
        for (int q = 0; q < P; ++q)
#pragma GCC unroll 4
          for (int j = 0; j < W; ++j) b[q][j] = format[q].decode(codes + q * code_stride + i * Format::kCodeBytes, J0 + j);
        if (P == 1 && keep)
#pragma GCC unroll 4
          for (int j = 0; j < W; ++j) pv::store(keep + i * kPanel + (J0 + j) * pv::VL, b[0][j]);
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) {
          const vf a = pv::splat(x[r * ldx + i]);
#pragma GCC unroll 4
          for (int q = 0; q < P; ++q)
#pragma GCC unroll 4
            for (int j = 0; j < W; ++j) acc[q][r][j] = pv::fma(a, b[q][j], acc[q][r][j]);
        }
      } else {  // AVX2's whole panels (one or two rows): R broadcasts, then one decoded vector at a time into R rows' FMAs
        vf a[R];
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) a[r] = pv::splat(x[r * ldx + i]);
#pragma GCC unroll 4
        for (int q = 0; q < P; ++q)
#pragma GCC unroll 4
          for (int j = 0; j < V; ++j) {
            const vf b = format[q].decode(codes + q * code_stride + i * Format::kCodeBytes, j);
            if (P == 1 && keep) pv::store(keep + i * kPanel + j * pv::VL, b);
#pragma GCC unroll 12
            for (int r = 0; r < R; ++r) acc[q][r][j] = pv::fma(a[r], b, acc[q][r][j]);
          }
      }
    }
  }
#pragma GCC unroll 4
  for (int q = 0; q < P; ++q)
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < W; ++j) pv::store(y + r * ldy + q * kPanel + (J0 + j) * pv::VL, acc[q][r][j]);
}

// One block of R rows over one panel. On AVX2, 3 to 5 rows take the panel in two halves of 16 columns,
// one after the other: 4 R accumulators, R broadcasts and the decoding do not fit in 16 ymm from 3 rows
// on (a spilled accumulator puts a store and a reload into its FMA chain); 2 R accumulators, two
// decoded vectors and one broadcast do, up to 5 rows (with Q4_1's low nibbles shifted out at 5). Each
// half decodes its own columns, so the panel is still decoded once, and every sum keeps its k order.
// Two rows fit whole, and run faster so from memory.
template <typename Format, int R>
void row_block(const float* x, int64_t ldx, const uint8_t* codes, const float* scales, int64_t k, float* y,
               int64_t ldy, const float* bias, bool prefetch, float* keep) {
  if constexpr (V == 4 && R > 2 && !std::is_same_v<Format, DecodedPanel>) {
    using F = std::conditional_t<std::is_same_v<Format, Q4Blocks> && R >= 5, Q4Format<true>, Format>;
    microkernel<F, R, 1, 0, 2>(x, ldx, codes, scales, k, y, ldy, bias, prefetch, keep);
    microkernel<F, R, 1, 2, 4>(x, ldx, codes, scales, k, y, ldy, bias, false, keep);
  } else {
    microkernel<Format, R>(x, ldx, codes, scales, k, y, ldy, bias, prefetch, keep);
  }
}

using Microkernel = void (*)(const float*, int64_t, const uint8_t*, const float*, int64_t, float*, int64_t, const float*, bool,
                             float*);
template <typename F, int... R>
constexpr std::array<Microkernel, kMaxRows + 1> microkernel_table(std::integer_sequence<int, R...>) {
  return {nullptr, &row_block<F, R + 1>...};
}
template <typename F>
constexpr auto kMicrokernels = microkernel_table<F>(std::make_integer_sequence<int, kMaxRows>{});

// One row takes two panels per microkernel call (see microkernel): two independent FMA chains per
// column vector instead of one hide the FMA latency that a single row cannot, on AVX2 (4 vectors a
// panel) as on AVX-512 (docs/HISTORY.md has both measurements).
constexpr int64_t kOneRowPanels = 2;

// The threads claim runs of panels. Up to kMaxRows rows are one row block; more are split evenly into
// blocks of up to kSplitRows (row_blocks.h). A panel's first block decodes it in registers and, when
// more blocks follow, also stores the float32 weights it decoded in a per-thread buffer ([K, 32]: 74 KB
// at K = 576, in L2), which the later blocks read as packed_gemm reads its panels: each panel is decoded
// once per call, not once per row block, and many rows cost no more than from the float32 panels. (On
// AVX2 those later blocks run whole panels of 3 rows, faster than halves of 5 once nothing is decoded.)
template <typename F>
void run_panels(const float* xp, int64_t k, const uint8_t* codes, const float* scales, int64_t panels, int64_t m,
                int64_t n, const float* bias, float* yp) {
  if (m == 0) return;
  const tritonllm::RowBlocks row_blocks(m, m <= kMaxRows ? kMaxRows : kSplitRows);
  const int64_t group = m == 1 ? kOneRowPanels : 1, full_panels = n / kPanel;
  const int64_t grain = (tritonllm::grain_for(panels, kClaimsPerThread) + group - 1) / group * group;
  tritonllm::parallel_claim(panels, grain, tritonllm::ClaimOrder::kOwnRuns, [&](tritonllm::ClaimedChunks::Claimer& items) {
    alignas(64) float tail[kMaxRows * kPanel];  // the last panel's block when N is not a multiple of 32
    alignas(64) float tail_bias[kPanel] = {};
    // Kept across calls: a fresh buffer of this size would come from mmap, page faults and all, every call.
    thread_local std::vector<float> decoded;
    if (m > kMaxRows && decoded.size() < static_cast<size_t>(k * kPanel)) decoded.resize(k * kPanel);
    for (int64_t begin, end; items.next(begin, end);) {
      int64_t p = begin;
      for (; group > 1 && p + group <= std::min(end, full_panels); p += group)
        microkernel<F, 1, kOneRowPanels>(xp, k, codes + p * k * F::kCodeBytes, scales + p * (k / kBlock) * F::kScaleFloats,
                                         k, yp + p * kPanel, n, bias ? bias + p * kPanel : nullptr, true, nullptr);
      for (; p < end; ++p) {
        const uint8_t* pc = codes + p * k * F::kCodeBytes;
        const float* ps = scales + p * (k / kBlock) * F::kScaleFloats;
        const int64_t col0 = p * kPanel, cols = std::min(kPanel, n - col0);
        for (int64_t blk = 0; blk < row_blocks.count; ++blk) {
          const int64_t r0 = row_blocks.start(blk);
          const int rows = row_blocks.rows(blk);
          const bool first = blk == 0;  // meets the panel cold: prefetches its codes, keeps what it decodes
          float* keep = first && m > kMaxRows ? decoded.data() : nullptr;
          float* y = cols == kPanel ? yp + r0 * n + col0 : tail;
          const int64_t ldy = cols == kPanel ? n : kPanel;
          const float* b = bias ? (cols == kPanel ? bias + col0 : tail_bias) : nullptr;
          if (bias && cols < kPanel) std::copy(bias + col0, bias + n, tail_bias);
          if (first)
            kMicrokernels<F>[rows](xp + r0 * k, k, pc, ps, k, y, ldy, b, true, keep);
          else
            kMicrokernels<DecodedPanel>[rows](xp + r0 * k, k, reinterpret_cast<const uint8_t*>(decoded.data()),
                                              nullptr, k, y, ldy, b, false, nullptr);
          if (cols < kPanel)
            for (int r = 0; r < rows; ++r) std::copy(tail + r * kPanel, tail + r * kPanel + cols, yp + (r0 + r) * n + col0);
        }
      }
    }
  });
}

#endif

}  // namespace

namespace tritonllm {

at::Tensor block_gemm(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& bias_in, int64_t out_features) {
#if TRITONLLM_PANEL_GEMM
  const tritonllm::BlockGemmCall call("block_gemm", x_in, codes, scales, bias_in, out_features);
  call.by_format<Q4Blocks, Q8Blocks, Bf16Values>([&](auto format) {
    run_panels<decltype(format)>(call.x.data_ptr<float>(), call.k, call.codes, call.scales, call.panels, call.m,
                                 call.n, call.bias, call.y.data_ptr<float>());
  });
  return call.result();
#else
  TORCH_CHECK(false, "block_gemm: built without AVX-512 or AVX2 + FMA");
#endif
}

}  // namespace tritonllm
