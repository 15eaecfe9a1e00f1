// Multi-LoRA's per-row deltas in one call per linear (layers/lora.py): for each run of rows that use one
// adapter, the shrink s = x A^T to the adapter's ranks, then the expand y += s B, part by part over a
// fused linear's output columns (B is zero elsewhere, so those products are skipped).
//
// Why a kernel of our own: a step of 64 rows over 4 adapters is 4 shrinks and up to 12 expands per
// linear, each a GEMM of a few rows by a few dozen ranks. Through aten that is hundreds of small calls
// per step, each paying dispatch and allocation and most of a thread hand-off, so the deltas cost far
// more than their multiply-adds. Here a linear's whole delta is one parallel region: every adapter's
// rows in blocks of kRows (one weight load serves them all), the shrinks, a barrier, the expands.
//
// The shrink is dot products along `in` (A's rows are contiguous there), kRows rows by 4 ranks at a
// time; the expand broadcasts a rank's value of each row against B's row, kRows rows by kExpandVectors
// vectors of columns. Sums are in rank order, as float32 GEMMs take them, not bit for bit aten's.

#include "lora_delta.h"

#include <ATen/Parallel.h>

#include <ATen/core/List.h>

#include "ops.h"

#include <algorithm>
#include <vector>

#include "panel_vectors.h"

namespace tritonllm::lora {
namespace {

constexpr int64_t kRows = 4;             // rows of one adapter computed together
constexpr int64_t kRanksPerTile = 4;     // shrink: ranks per tile (kRows x 4 vector sums)
constexpr int64_t kColumnChunk = 256;    // expand: output columns per work item
// Below this many multiply-adds (a few microseconds on one core) a call runs on its own thread: one
// row's delta is less work than waking the other threads and meeting them at the barrier.
constexpr int64_t kParallelMacs = 1 << 18;

struct Block {
  int64_t slot, row, rows;
};

struct ExpandItem {
  int64_t block, part, first, end;  // columns [first, end) of one part of the block's adapter
};

#if TRITONLLM_PANEL_GEMM
using panel::vf;
using panel::VL;
constexpr int kExpandVectors = VL == 16 ? 4 : 2;  // accumulators kRows x this, within the vector registers

inline float sum_lanes(vf v) {
  float s = 0.f;
  for (int l = 0; l < VL; ++l) s += v[l];
  return s;
}

// s[r][j0 + t] = dot(x[r], a[j0 + t]) for R rows and J ranks.
template <int R, int J>
void shrink_tile(const float* const* xr, const float* a, int64_t in, int64_t j0, float* const* sr) {
  vf acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < J; ++t) acc[r][t] = panel::zero();
  const float* arow[J];
  for (int t = 0; t < J; ++t) arow[t] = a + (j0 + t) * in;
  int64_t k = 0;
  for (; k + VL <= in; k += VL) {
    vf av[J];
    for (int t = 0; t < J; ++t) av[t] = panel::load(arow[t] + k);
    for (int r = 0; r < R; ++r) {
      const vf xv = panel::load(xr[r] + k);
      for (int t = 0; t < J; ++t) acc[r][t] = panel::fma(xv, av[t], acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < J; ++t) {
      float s = sum_lanes(acc[r][t]);
      for (int64_t kk = k; kk < in; ++kk) s += xr[r][kk] * arow[t][kk];
      sr[r][j0 + t] = s;
    }
}

template <int R>
void shrink_rows(const float* const* xr, const float* a, int64_t in, int64_t ranks, float* const* sr) {
  int64_t j = 0;
  for (; j + kRanksPerTile <= ranks; j += kRanksPerTile) shrink_tile<R, kRanksPerTile>(xr, a, in, j, sr);
  switch (ranks - j) {
    case 3: shrink_tile<R, 3>(xr, a, in, j, sr); break;
    case 2: shrink_tile<R, 2>(xr, a, in, j, sr); break;
    case 1: shrink_tile<R, 1>(xr, a, in, j, sr); break;
    default: break;
  }
}

// y[r][c0, c1) += sum over ranks j in [j0, j1) of s[r][j] * b[j][c0, c1), NV vectors of columns at a time.
template <int R, int NV>
int64_t expand_columns(float* const* yr, const float* const* sr, const float* b, int64_t ldb, int64_t j0, int64_t j1,
                       int64_t c0, int64_t c1) {
  int64_t c = c0;
  for (; c + NV * VL <= c1; c += NV * VL) {
    vf acc[R][NV];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) acc[r][v] = panel::load(yr[r] + c + v * VL);
    for (int64_t j = j0; j < j1; ++j) {
      const float* brow = b + j * ldb + c;
      vf bv[NV];
      for (int v = 0; v < NV; ++v) bv[v] = panel::load(brow + v * VL);
      for (int r = 0; r < R; ++r) {
        const vf s = panel::splat(sr[r][j]);
        for (int v = 0; v < NV; ++v) acc[r][v] = panel::fma(s, bv[v], acc[r][v]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) panel::store(yr[r] + c + v * VL, acc[r][v]);
  }
  return c;
}

template <int R>
void expand_rows(float* const* yr, const float* const* sr, const float* b, int64_t ldb, int64_t j0, int64_t j1,
                 int64_t c0, int64_t c1) {
  int64_t c = expand_columns<R, kExpandVectors>(yr, sr, b, ldb, j0, j1, c0, c1);
  c = expand_columns<R, 1>(yr, sr, b, ldb, j0, j1, c, c1);
  for (; c < c1; ++c)
    for (int r = 0; r < R; ++r) {
      float acc = yr[r][c];
      for (int64_t j = j0; j < j1; ++j) acc += sr[r][j] * b[j * ldb + c];
      yr[r][c] = acc;
    }
}
#else
// Without the panel vectors (no AVX2 with FMA, no AVX-512: e.g. aarch64), loops the compiler vectorises.
template <int R>
void shrink_rows(const float* const* xr, const float* a, int64_t in, int64_t ranks, float* const* sr) {
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < ranks; ++j) {
      const float* arow = a + j * in;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < in; ++k) s += xr[r][k] * arow[k];
      sr[r][j] = s;
    }
}

template <int R>
void expand_rows(float* const* yr, const float* const* sr, const float* b, int64_t ldb, int64_t j0, int64_t j1,
                 int64_t c0, int64_t c1) {
  for (int r = 0; r < R; ++r)
    for (int64_t j = j0; j < j1; ++j) {
      const float s = sr[r][j];
      const float* brow = b + j * ldb;
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) yr[r][c] += s * brow[c];
    }
}
#endif

void shrink_block(int64_t rows, const float* const* xr, const float* a, int64_t in, int64_t ranks, float* const* sr) {
  switch (rows) {
    case 4: shrink_rows<4>(xr, a, in, ranks, sr); break;
    case 3: shrink_rows<3>(xr, a, in, ranks, sr); break;
    case 2: shrink_rows<2>(xr, a, in, ranks, sr); break;
    default: shrink_rows<1>(xr, a, in, ranks, sr); break;
  }
}

void expand_block(int64_t rows, float* const* yr, const float* const* sr, const float* b, int64_t ldb, int64_t j0,
                  int64_t j1, int64_t c0, int64_t c1) {
  switch (rows) {
    case 4: expand_rows<4>(yr, sr, b, ldb, j0, j1, c0, c1); break;
    case 3: expand_rows<3>(yr, sr, b, ldb, j0, j1, c0, c1); break;
    case 2: expand_rows<2>(yr, sr, b, ldb, j0, j1, c0, c1); break;
    default: expand_rows<1>(yr, sr, b, ldb, j0, j1, c0, c1); break;
  }
}

static_assert(kRows == 4, "shrink_block and expand_block dispatch on up to 4 rows");

}  // namespace

void add_delta(float* y, int64_t y_stride, const float* x, int64_t x_stride, int64_t in, int64_t out,
               const Adapter* slots, int64_t num_slots, const int64_t* segments, int64_t num_segments) {
  std::vector<Block> blocks;
  int64_t max_ranks = 0;
  for (int64_t s = 0; s < num_segments; ++s) {
    const int64_t slot = segments[3 * s], first = segments[3 * s + 1], end = segments[3 * s + 2];
    TORCH_CHECK(slot >= 0 && slot < num_slots && first >= 0 && first <= end, "lora_delta: a segment names slot ", slot,
                " of ", num_slots, " or rows ", first, "..", end);
    if (slots[slot].a == nullptr) continue;
    max_ranks = std::max(max_ranks, slots[slot].ranks);
    for (int64_t row = first; row < end; row += kRows) blocks.push_back({slot, row, std::min(kRows, end - row)});
  }
  if (blocks.empty()) return;
  // One part (every rank row to every column) where the adapter gives none.
  auto part = [&](const Adapter& ad, int64_t p, int64_t* q) {
    if (ad.num_parts == 0) {
      q[0] = 0, q[1] = ad.ranks, q[2] = 0, q[3] = out;
      return;
    }
    for (int i = 0; i < 4; ++i) q[i] = ad.parts[4 * p + i];
  };
  std::vector<ExpandItem> items;
  int64_t macs = 0;
  for (int64_t k = 0; k < static_cast<int64_t>(blocks.size()); ++k) {
    const Adapter& ad = slots[blocks[k].slot];
    for (int64_t p = 0; p < std::max<int64_t>(ad.num_parts, 1); ++p) {
      int64_t q[4];
      part(ad, p, q);
      macs += blocks[k].rows * ((q[1] - q[0]) * (q[3] - q[2]) + (p == 0 ? ad.ranks * in : 0));
      for (int64_t c = q[2]; c < q[3]; c += kColumnChunk) items.push_back({k, p, c, std::min(c + kColumnChunk, q[3])});
    }
  }
  std::vector<float> shrunk(blocks.size() * kRows * max_ranks);
  const int64_t num_blocks = static_cast<int64_t>(blocks.size()), num_items = static_cast<int64_t>(items.size());
  auto rows_of = [&](int64_t k, const float** xr, float** yr, float** sr) {
    const Block& bl = blocks[k];
    for (int64_t r = 0; r < bl.rows; ++r) {
      xr[r] = x + (bl.row + r) * x_stride;
      yr[r] = y + (bl.row + r) * y_stride;
      sr[r] = shrunk.data() + (k * kRows + r) * max_ranks;
    }
  };
  // One region for both phases: the expands wait at the barrier for every shrink.
  const int threads = macs < kParallelMacs ? 1 : static_cast<int>(std::min<int64_t>(at::get_num_threads(), std::max(num_blocks, num_items)));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(static)
    for (int64_t k = 0; k < num_blocks; ++k) {
      const float* xr[kRows];
      float* yr[kRows];
      float* sr[kRows];
      rows_of(k, xr, yr, sr);
      const Adapter& ad = slots[blocks[k].slot];
      shrink_block(blocks[k].rows, xr, ad.a, in, ad.ranks, sr);
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < num_items; ++i) {
      const ExpandItem& it = items[i];
      const float* xr[kRows];
      float* yr[kRows];
      float* sr[kRows];
      rows_of(it.block, xr, yr, sr);
      const Adapter& ad = slots[blocks[it.block].slot];
      int64_t q[4];
      part(ad, it.part, q);
      expand_block(blocks[it.block].rows, yr, sr, ad.b, out, q[0], q[1], it.first, it.end);
    }
  }
}

namespace {

void check_rows(const at::Tensor& y, const at::Tensor& x, at::IntArrayRef segments) {
  TORCH_CHECK(y.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat && y.dim() == 2 && x.dim() == 2 &&
                  y.size(0) == x.size(0) && y.stride(1) == 1 && x.stride(1) == 1,
              "lora_delta: x [rows, in] and y [rows, out] float32, each row contiguous");
  TORCH_CHECK(segments.size() % 3 == 0, "lora_delta: segments are (slot, first row, end row) triples");
  for (size_t s = 0; s < segments.size(); s += 3)
    TORCH_CHECK(segments[s + 2] <= y.size(0), "lora_delta: a segment ends past the step's ", y.size(0), " rows");
}

// Per slot: its adapter's a [ranks, in], b [ranks, out] and parts [P, 4] (int64), or None for a slot that
// leaves this linear alone. Checked here, once per call, so that the kernel can trust the pointers.
std::vector<Adapter> adapters_of(const c10::List<c10::optional<at::Tensor>>& a, const c10::List<c10::optional<at::Tensor>>& b,
                                 const c10::List<c10::optional<at::Tensor>>& parts, int64_t count, int64_t in,
                                 int64_t out) {
  std::vector<Adapter> slots(count);
  for (int64_t s = 0; s < count; ++s) {
    const c10::optional<at::Tensor> as = a.get(s), bs = b.get(s), ps = parts.get(s);
    if (!as.has_value() || !as->defined()) continue;
    TORCH_CHECK(bs.has_value() && bs->defined(), "lora_delta: an adapter's A without its B");
    TORCH_CHECK(as->scalar_type() == at::kFloat && bs->scalar_type() == at::kFloat && as->is_contiguous() &&
                    bs->is_contiguous() && as->dim() == 2 && bs->dim() == 2 && as->size(1) == in &&
                    bs->size(0) == as->size(0) && bs->size(1) == out,
                "lora_delta: for x of ", in, " columns and y of ", out, ", A [ranks, ", in, "] and B [ranks, ", out,
                "] contiguous float32; got A ", as->sizes(), " and B ", bs->sizes());
    Adapter& ad = slots[s];
    ad.a = as->data_ptr<float>();
    ad.b = bs->data_ptr<float>();
    ad.ranks = as->size(0);
    if (ps.has_value() && ps->defined() && ps->numel() > 0) {
      TORCH_CHECK(ps->scalar_type() == at::kLong && ps->is_contiguous() && ps->dim() == 2 && ps->size(1) == 4,
                  "lora_delta: parts [P, 4] int64");
      const int64_t* q = ps->data_ptr<int64_t>();
      for (int64_t p = 0; p < ps->size(0); ++p)
        TORCH_CHECK(0 <= q[4 * p] && q[4 * p] <= q[4 * p + 1] && q[4 * p + 1] <= ad.ranks && 0 <= q[4 * p + 2] &&
                        q[4 * p + 2] <= q[4 * p + 3] && q[4 * p + 3] <= out,
                    "lora_delta: a part outside the adapter's ranks or the output");
      ad.parts = q;
      ad.num_parts = ps->size(0);
    }
  }
  return slots;
}

}  // namespace

void add_delta_from_table(at::Tensor& y, const at::Tensor& x, const int64_t* table, int64_t num_slots,
                          at::IntArrayRef segments) {
  check_rows(y, x, segments);
  std::vector<Adapter> slots(num_slots);
  for (int64_t s = 0; s < num_slots; ++s) {
    const int64_t* row = table + 5 * s;
    if (row[0] == 0) continue;
    slots[s] = Adapter{reinterpret_cast<const float*>(row[0]), reinterpret_cast<const float*>(row[1]), row[2],
                       reinterpret_cast<const int64_t*>(row[3]), row[4]};
  }
  add_delta(y.data_ptr<float>(), y.stride(0), x.data_ptr<float>(), x.stride(0), x.size(1), y.size(1), slots.data(),
                  num_slots, segments.data(), static_cast<int64_t>(segments.size()) / 3);
}

}  // namespace tritonllm::lora

namespace tritonllm {

at::Tensor lora_delta_(at::Tensor& y, const at::Tensor& x, const c10::List<c10::optional<at::Tensor>>& a,
                       const c10::List<c10::optional<at::Tensor>>& b, const c10::List<c10::optional<at::Tensor>>& parts,
                       at::IntArrayRef segments) {
  TORCH_CHECK(a.size() == b.size() && a.size() == parts.size(), "lora_delta_: one A, B and parts per slot");
  lora::check_rows(y, x, segments);
  const int64_t num_slots = static_cast<int64_t>(a.size());
  std::vector<lora::Adapter> slots = lora::adapters_of(a, b, parts, num_slots, x.size(1), y.size(1));
  lora::add_delta(y.data_ptr<float>(), y.stride(0), x.data_ptr<float>(), x.stride(0), x.size(1), y.size(1), slots.data(),
                  num_slots, segments.data(), static_cast<int64_t>(segments.size()) / 3);
  return y;
}

}  // namespace tritonllm
