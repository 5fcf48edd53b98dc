// Request-level checks shared by the handlers: layers, dtypes, sequence
// plans. Each returns INVALID_ARGUMENT naming the field.
#ifndef KVDEPOT_SERVER_REQUEST_CHECKS_H_
#define KVDEPOT_SERVER_REQUEST_CHECKS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/format.h"
#include "kernels/store_load.h"
#include "kvdepot/v1/kvdepot.pb.h"
#include "planner/plan.h"

namespace kvdepot {

// `layer` in [0, num_layers).
absl::Status CheckLayer(absl::string_view field, int64_t layer,
                        const PoolLayout& layout);

// A known InputDtype; *bytes receives its element size.
absl::StatusOr<InputDtype> ToInputDtype(absl::string_view field,
                                        v1::InputDtype dtype, int64_t* bytes);

// A compression ratio field: 0 -> 1, else >= 1 and pool block_size * R fits
// int32.
absl::StatusOr<int32_t> CheckRatio(absl::string_view field, int32_t ratio,
                                   const PoolLayout& layout);

// Decoded SequencePlan arrays; views point into the vectors.
struct DecodedSequences {
  std::vector<int32_t> seqlen_k;     // [num_seqs]
  std::vector<int32_t> block_table;  // [num_seqs][max_blocks_per_seq]
  SequenceBatch batch;
  CompressedParams params;
};

// Decodes and shape-checks a SequencePlan against `layout`
// (field prefix `field`, e.g. "sequences").
absl::Status DecodeSequencePlan(absl::string_view field,
                                const v1::SequencePlan& plan,
                                const PoolLayout& layout, int64_t max_elements,
                                DecodedSequences* out);

// Builds the compressed plan of decoded sequences into `builder`;
// cu_rows receives [num_seqs + 1].
absl::Status BuildSequenceLoadPlan(const DecodedSequences& seqs,
                                   BlockLoadPlanBuilder* builder,
                                   std::vector<int32_t>* cu_rows);

// Block table view of [num_rows][num_cols] row-major data.
BlockTableView DenseTable(const std::vector<int32_t>& data, int64_t num_rows,
                          int64_t num_cols);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_REQUEST_CHECKS_H_
