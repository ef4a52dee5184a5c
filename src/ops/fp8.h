// FP8 weights (WFormat::FP8: E4M3 codes with one fp32 scale per 128 x 128 block, the format of the
// --trunk-fp8 option): the quantiser from a dense stored matrix, and the view of its result.
// Owns: how a dense matrix is rounded to FP8 (block scale = max|w| of the block / 448, code =
// e4m3(w / scale), a zero block scale 1). Must not: decide which weights are quantised (the model
// does: Model::quantize_trunk_fp8) or touch MXFP4 weights (used as shipped, never re-quantised).
#pragma once
#include <cstdint>
#include <string>

#include "ops/weight.h"

namespace k3::ops {

// Block row br (rows [128 br, min(rows, 128 br + 128)) of src, which is F32, F16 or BF16) in FP8:
// the codes of those rows at `codes` (row 128 br's first byte; cols bytes a row) and their
// fp8_block_cols(cols) scales at `scales`. k3::Error "<what>: ..." (one line) for another format or
// a non-finite weight (E4M3 has no infinity, and a NaN code would poison its block's products).
void quantize_fp8_block_row(const WeightMat& src, int64_t br, uint8_t* codes, float* scales, const std::string& what);

// The whole-matrix view of FP8 codes [rows, cols] and scales [ceil(rows/128), fp8_block_cols(cols)].
WeightMat fp8_matrix(const uint8_t* codes, const float* scales, int64_t rows, int64_t cols);

}  // namespace k3::ops
