// The load planner of SPEC §6 (planner/plan_builder.h, sequence_plans.h,
// prefill_layout.h): a BlockLoadPlanBuilder driven by a sequence of
// appends, the compressed and SWA plans, the SWA store slots, the prefill
// layout and its pivots. The first byte picks one.
// Properties: no crash or sanitizer report; errors are INVALID_ARGUMENT (or
// FAILED_PRECONDITION for an append after Finish) and change nothing; every
// plan is well formed (segments back to back from row 0, fields in range,
// total_k their sum); pivots expand (ExpandSwaIndex) without error.
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/plan.h"
#include "tests/fuzz/fuzz_input.h"
#include "tests/fuzz/planner_input.h"

namespace kvdepot::fuzz {
namespace {

// The plan invariants of plan_builder.h.
void CheckPlan(const BlockLoadPlanBuilder& b) {
  const absl::Span<const int32_t> seg = b.segments();
  FUZZ_CHECK(seg.size() % kSegmentFields == 0, "segments size %zu", seg.size());
  int64_t rows = 0;
  for (size_t i = 0; i < seg.size(); i += kSegmentFields) {
    const int32_t block = seg[i], begin = seg[i + 1], end = seg[i + 2],
                  dst = seg[i + 3];
    FUZZ_CHECK(block >= -1 && block < b.num_blocks(), "segment %zu block %d",
               i / 4, block);
    FUZZ_CHECK(0 <= begin && begin <= end && end <= b.source_block_size(),
               "segment %zu range [%d, %d)", i / 4, begin, end);
    FUZZ_CHECK(dst == rows, "segment %zu dst %d, expected %lld", i / 4, dst,
               static_cast<long long>(rows));
    rows += end - begin;
  }
  FUZZ_CHECK(rows == b.total_k(), "total_k %d, segments cover %lld",
             b.total_k(), static_cast<long long>(rows));
}

int32_t Positive(FuzzInput& in) {
  const int32_t v = in.Int32();
  return v > 0 ? v : 1 + (v == INT32_MIN ? 0 : -v) % 300;
}

void FuzzBuilder(FuzzInput& in) {
  // Arguments read in order (one input means one call in every build).
  const int32_t block_size = Positive(in);
  const int32_t num_blocks = Positive(in);
  BlockLoadPlanBuilder b(block_size, num_blocks);
  for (int op = 0; op < 16 && in.remaining() > 0; ++op) {
    const std::vector<int32_t> before(b.segments().begin(), b.segments().end());
    const int32_t total_before = b.total_k();
    const bool finished = b.finished();
    absl::Status s;
    switch (in.Byte() % 7) {
      case 0: {
        const int32_t block = in.Int32(), begin = in.Int32(), end = in.Int32();
        s = b.AppendSegment(block, begin, end);
        break;
      }
      case 1: {
        const int32_t n = in.Int32();
        // The callers bound zero fills (one row, or at most a window per
        // sequence); 2^31 one-token segments would only test the allocator.
        if (n / b.source_block_size() > kMaxOut) continue;
        s = b.AppendZeroFill(n);
        break;
      }
      case 2: {
        const std::vector<int32_t> table = in.Int32s(in.Range(0, 8));
        const int32_t t0 = in.Int32(), t1 = in.Int32();
        s = b.AppendPagedRange(table, t0, t1);
        break;
      }
      case 3: {
        const int32_t state = in.Int32(), t0 = in.Int32(), t1 = in.Int32();
        s = b.AppendRingRange(state, t0, t1);
        break;
      }
      case 4:
        b.Finish();
        continue;
      case 5:
        if (in.Bool()) {
          b.Reset();
        } else {
          const int32_t bs = Positive(in);
          b.Reset(bs, Positive(in));
        }
        continue;
      case 6:
        b.Reserve(in.Range(0, 64));
        continue;
    }
    if (s.ok()) {
      FUZZ_CHECK(!finished, "an append after Finish() succeeded");
    } else {
      // After Finish() bad arguments may be reported before the state.
      FUZZ_CHECK(
          s.code() == absl::StatusCode::kInvalidArgument ||
              (finished && s.code() == absl::StatusCode::kFailedPrecondition),
          "append: %s", s.ToString().c_str());
      FUZZ_CHECK(b.total_k() == total_before &&
                     std::vector<int32_t>(b.segments().begin(),
                                          b.segments().end()) == before,
                 "a failed append changed the builder");
    }
    CheckPlan(b);
  }
}

// A builder that already holds one segment: a failed call must leave it so.
struct Seeded {
  BlockLoadPlanBuilder b{4, 2};
  Seeded() { FUZZ_CHECK(b.AppendSegment(1, 1, 3).ok(), "seed segment"); }
  bool Untouched() const {
    return b.total_k() == 2 && b.num_segments() == 1 && b.segments()[0] == 1;
  }
};

void FuzzCompressedPlan(FuzzInput& in) {
  BatchInput batch;
  batch.Read(in);
  CompressedParams p;
  p.block_size = in.Int32();
  p.ratio = in.Bool() ? 1 : in.Int32();
  p.num_blocks = in.Int32();
  std::vector<int32_t> cu(OutSize(in, batch.batch.num_seqs() + 1), 7);
  Seeded seeded;
  const absl::Status s =
      BuildCompressedPlan(batch.batch, p, &seeded.b, absl::MakeSpan(cu));
  if (!s.ok()) {
    CheckRejection(s, "BuildCompressedPlan");
    FUZZ_CHECK(seeded.Untouched(), "BuildCompressedPlan changed the builder");
    for (int32_t x : cu) FUZZ_CHECK(x == 7, "cu_compressed written on error");
    return;
  }
  CheckPlan(seeded.b);
  FUZZ_CHECK(cu[0] == 0 && cu.back() == seeded.b.total_k(),
             "cu_compressed ends");
  for (size_t i = 0; i + 1 < cu.size(); ++i) {
    FUZZ_CHECK(cu[i + 1] - cu[i] == p.RowsFor(batch.seqlen_k[i]),
               "sequence %zu rows", i);
  }
}

SwaParams ReadSwaParams(FuzzInput& in) {
  SwaParams p;
  p.window = in.Int32();
  p.ring_size = in.Bool() ? p.window : in.Int32();
  p.num_states = in.Int32();
  return p;
}

void FuzzSwaPlan(FuzzInput& in) {
  BatchInput batch;
  batch.Read(in);
  const SwaParams p = ReadSwaParams(in);
  Seeded seeded;
  const absl::Status s = BuildSwaPlan(batch.batch, p, &seeded.b);
  if (!s.ok()) {
    CheckRejection(s, "BuildSwaPlan");
    FUZZ_CHECK(seeded.Untouched(), "BuildSwaPlan changed the builder");
  } else {
    CheckPlan(seeded.b);
    FUZZ_CHECK(seeded.b.total_k() == batch.batch.num_seqs() * p.window,
               "SWA plan total_k %d", seeded.b.total_k());
    FUZZ_CHECK(seeded.b.num_segments() <= 3 * batch.batch.num_seqs(),
               "more than three segments per sequence");
  }
  std::vector<int32_t> slots(OutSize(in, batch.TotalQ()), 7);
  const absl::Status t =
      BuildSwaStoreSlots(batch.batch, p, absl::MakeSpan(slots));
  if (!t.ok()) {
    CheckRejection(t, "BuildSwaStoreSlots");
    for (int32_t x : slots) FUZZ_CHECK(x == 7, "slots written on error");
    return;
  }
  for (int32_t x : slots) {
    FUZZ_CHECK(x == -1 || (x >= 0 && x < static_cast<int64_t>(p.ring_size) *
                                             p.num_states),
               "slot %d", x);
  }
}

void FuzzPrefill(FuzzInput& in) {
  BatchInput batch;
  batch.Read(in);
  const int32_t window = in.Int32();
  const int32_t ratio = in.Int32();
  absl::StatusOr<PrefillLayout> l =
      ComputePrefillLayout(batch.batch, window, ratio);
  if (!l.ok()) {
    CheckRejection(l.status(), "ComputePrefillLayout");
    return;
  }
  FUZZ_CHECK(l->main_kv_offset == l->swa_history_rows + l->chunk_rows &&
                 l->total_rows == l->main_kv_offset + l->compressed_rows &&
                 l->swa_history_rows >= 0 && l->compressed_rows >= 0,
             "inconsistent layout");
  if (window <= 0) return;  // ComputeSwaPivots REQUIRES W > 0
  std::vector<int32_t> pivots(OutSize(in, Mul(l->chunk_rows, kPivotFields)), 7);
  const absl::Status s =
      ComputeSwaPivots(batch.batch, *l, absl::MakeSpan(pivots));
  if (!s.ok()) {
    CheckRejection(s, "ComputeSwaPivots");
    for (int32_t x : pivots) FUZZ_CHECK(x == 7, "pivots written on error");
    return;
  }
  std::vector<int32_t> index(
      OutSize(in, Mul(static_cast<int64_t>(pivots.size() / 4), window)));
  if (static_cast<int64_t>(index.size()) ==
      Mul(static_cast<int64_t>(pivots.size() / 4), window)) {
    const absl::Status e = ExpandSwaIndex(pivots, window, l->main_kv_offset,
                                          absl::MakeSpan(index));
    FUZZ_CHECK(e.ok(), "the planner's pivots do not expand: %s",
               e.ToString().c_str());
  }
}

}  // namespace
}  // namespace kvdepot::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvdepot::fuzz;
  FuzzInput in(data, size);
  switch (in.Byte() % 4) {
    case 0:
      FuzzBuilder(in);
      break;
    case 1:
      FuzzCompressedPlan(in);
      break;
    case 2:
      FuzzSwaPlan(in);
      break;
    case 3:
      FuzzPrefill(in);
      break;
  }
  return 0;
}
