// A step's plan as library mode takes it (Step.PlanStep, docs/LIBRARY_MODE.md):
// the blob BuildStepPlan checked and built, plus the per-row inputs
// kvdk_convert_topk_* needs (each row's block-table row, and per ratio of
// the phase-B layers its compressed-token count and valid columns), with
// the section offsets named in a PlanStepResponse.
#ifndef KVDEPOT_SERVER_STEP_PLAN_EXPORT_H_
#define KVDEPOT_SERVER_STEP_PLAN_EXPORT_H_

#include "absl/status/statusor.h"
#include "kvdepot/v1/step.pb.h"
#include "server/step/step_config.h"
#include "server/step/step_plan.h"

namespace kvdepot::step {

// The most metadata a PlanStep reply carries: the daemon's default gRPC
// message limit (--max_message_bytes), which also bounds what one call
// makes the daemon allocate.
inline constexpr int64_t kMaxPlanStepMetadataBytes = int64_t{64} << 20;

// The PlanStepResponse of `plan`, built by BuildStepPlan. The blob's own
// sections keep their offsets; the row tables and top-k sections are
// appended. Device-resident forms are the worker's own and read by no
// one here: with slot_mappings_in_buffer the slot sections are -1; with
// block_tables_in_buffer there are no row tables (-1), and every sequence
// must have one query token (row r = sequence r; else INVALID_ARGUMENT
// block_tables_in_buffer). INVALID_ARGUMENT (num_tokens) when they
// would pass kMaxPlanStepMetadataBytes, before anything is allocated.
absl::StatusOr<v1::PlanStepResponse> ExportStepPlan(
    const RegistrationConfig& config, StepPlan plan);

}  // namespace kvdepot::step

#endif  // KVDEPOT_SERVER_STEP_PLAN_EXPORT_H_
