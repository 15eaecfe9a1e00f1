// How a GEMM's microkernels split M rows into blocks of at most `max_rows`: as few blocks as that
// allows, their sizes differing by at most one (64 rows at 12: 11, 11, 11, 11, 10, 10, not five of
// 12 and a 4). A block of few rows keeps few FMA chains in flight and pays its panel's loads for
// little arithmetic. The grouping never changes a result: each row's sums are its own.
#pragma once

#include <cstdint>

namespace tritonllm {

struct RowBlocks {
  int64_t count, base, extra;  // `extra` blocks of base + 1 rows, then the rest of base rows

  RowBlocks(int64_t rows, int64_t max_rows)
      : count((rows + max_rows - 1) / max_rows), base(count ? rows / count : 0), extra(count ? rows % count : 0) {}

  int64_t start(int64_t b) const { return b * base + (b < extra ? b : extra); }
  int rows(int64_t b) const { return static_cast<int>(base + (b < extra ? 1 : 0)); }
};

}  // namespace tritonllm
