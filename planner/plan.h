// The planner: everything between a scheduler's per-sequence metadata and
// the kernels' plans and indices (SPEC §6, §7), as plain C++ on host arrays.
//
//   batch.h          SequenceBatch, BlockTableView and their validation
//   plan_builder.h   BlockLoadPlanBuilder: segments {block, begin, end, dst}
//   sequence_plans.h compressed plan (+ cu_compressed), SWA plan, SWA store
//                    slots
//   prefill_layout.h prefill buffer layout and the SWA pivots of its queries
//   index_ops.h      expand_swa_index, kv_index_cat
//   decode_index.h   convert_topk, SWA decode index
#ifndef KVDEPOT_PLANNER_PLAN_H_
#define KVDEPOT_PLANNER_PLAN_H_

#include "planner/batch.h"           // IWYU pragma: export
#include "planner/decode_index.h"    // IWYU pragma: export
#include "planner/index_ops.h"       // IWYU pragma: export
#include "planner/plan_builder.h"    // IWYU pragma: export
#include "planner/prefill_layout.h"  // IWYU pragma: export
#include "planner/sequence_plans.h"  // IWYU pragma: export

#endif  // KVDEPOT_PLANNER_PLAN_H_
