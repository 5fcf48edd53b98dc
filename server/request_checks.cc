#include "server/request_checks.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "proto/wire.h"

namespace kvdepot {

absl::Status CheckLayer(absl::string_view field, int64_t layer,
                        const PoolLayout& layout) {
  if (layer < 0 || layer >= layout.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " = ", layer, " is outside [0, ", layout.num_layers, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<InputDtype> ToInputDtype(absl::string_view field,
                                        v1::InputDtype dtype, int64_t* bytes) {
  switch (dtype) {
    case v1::INPUT_DTYPE_BF16:
      *bytes = 2;
      return InputDtype::kBF16;
    case v1::INPUT_DTYPE_FP32:
      *bytes = 4;
      return InputDtype::kFP32;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(field, " = ", static_cast<int>(dtype),
                       " is not BF16 (0) or FP32 (1)"));
  }
}

absl::StatusOr<int32_t> CheckRatio(absl::string_view field, int32_t ratio,
                                   const PoolLayout& layout) {
  if (ratio == 0) ratio = 1;
  if (ratio < 1 || layout.block_size * ratio > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " = ", ratio, " must be >= 1 with block_size * ratio < 2^31"));
  }
  return ratio;
}

BlockTableView DenseTable(const std::vector<int32_t>& data, int64_t num_rows,
                          int64_t num_cols) {
  BlockTableView v;
  v.data = data;
  v.num_rows = num_rows;
  v.num_cols = static_cast<int32_t>(num_cols);
  v.row_stride = num_cols;
  return v;
}

absl::Status DecodeSequencePlan(absl::string_view field,
                                const v1::SequencePlan& plan,
                                const PoolLayout& layout, int64_t max_elements,
                                DecodedSequences* out) {
  const std::string f(field);
  if (plan.num_seqs() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(f, ".num_seqs = ", plan.num_seqs(), " must be >= 1"));
  }
  if (plan.max_blocks_per_seq() < 1 || plan.max_blocks_per_seq() > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat(f, ".max_blocks_per_seq = ", plan.max_blocks_per_seq(),
                     " is outside [1, 2^31)"));
  }
  RETURN_IF_ERROR(DecodeInt32s(absl::StrCat(f, ".seqlen_k"), plan.seqlen_k(),
                               absl::StrCat(f, ".num_seqs"), plan.num_seqs(),
                               max_elements, &out->seqlen_k));
  const int64_t cells = plan.num_seqs() * plan.max_blocks_per_seq();
  RETURN_IF_ERROR(
      DecodeInt32s(absl::StrCat(f, ".block_table"), plan.block_table(),
                   absl::StrCat(f, ".num_seqs * max_blocks_per_seq"), cells,
                   max_elements, &out->block_table));
  absl::StatusOr<int32_t> ratio = CheckRatio(absl::StrCat(f, ".compress_ratio"),
                                             plan.compress_ratio(), layout);
  if (!ratio.ok()) return ratio.status();
  out->params.ratio = *ratio;
  out->params.block_size = static_cast<int32_t>(layout.block_size * *ratio);
  out->params.num_blocks = static_cast<int32_t>(layout.num_blocks);
  // The plan gets a segment per compressed block read and one per empty
  // sequence (BuildCompressedPlan): bounded before anything is built, as
  // Load bounds the segments it is given, so the plan of a table of
  // --max_array_elements entries cannot take 4x that.
  const int64_t bs = out->params.source_block_size();
  int64_t segments = 0;
  for (const int32_t k : out->seqlen_k) {
    const int64_t tokens = k > 0 ? k / *ratio : 0;  // k < 0: refused later
    segments += tokens == 0 ? 1 : (tokens + bs - 1) / bs;
  }
  if (segments > max_elements / 4) {
    return absl::InvalidArgumentError(
        absl::StrCat(f, ": the plan would have ", segments,
                     " segments, more than the ", max_elements / 4,
                     " a plan may have (--max_array_elements / 4, as "
                     "for Load's segments); split the batch"));
  }
  out->batch = SequenceBatch{};
  out->batch.seqlen_k = out->seqlen_k;
  out->batch.block_table =
      DenseTable(out->block_table, plan.num_seqs(), plan.max_blocks_per_seq());
  return absl::OkStatus();
}

absl::Status BuildSequenceLoadPlan(const DecodedSequences& seqs,
                                   BlockLoadPlanBuilder* builder,
                                   std::vector<int32_t>* cu_rows) {
  cu_rows->assign(seqs.seqlen_k.size() + 1, 0);
  return BuildCompressedPlan(seqs.batch, seqs.params, builder,
                             absl::MakeSpan(*cu_rows));
}

}  // namespace kvdepot
