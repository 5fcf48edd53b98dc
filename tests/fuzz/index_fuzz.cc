// The index operations of SPEC §7 (planner/decode_index.h, index_ops.h):
// ConvertTopk, ExpandSwaDecodeIndex, ComputeSwaDecodeWindows and
// BuildSwaDecodeIndex, ExpandSwaIndex, KvIndexCat. The first byte picks one.
// Properties: no crash or sanitizer report; an error is INVALID_ARGUMENT and
// writes nothing; every index written is -1 or inside the range it indexes;
// BuildSwaDecodeIndex equals ExpandSwaDecodeIndex of the computed windows.
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/plan.h"
#include "tests/fuzz/fuzz_input.h"
#include "tests/fuzz/planner_input.h"

namespace kvdepot::fuzz {
namespace {

void CheckAllIn(const std::vector<int32_t>& v, int64_t lo, int64_t hi,
                const char* what) {
  for (size_t i = 0; i < v.size(); ++i) {
    FUZZ_CHECK(v[i] == -1 || (v[i] >= lo && v[i] < hi),
               "%s[%zu] = %d outside [%lld, %lld)", what, i, v[i],
               static_cast<long long>(lo), static_cast<long long>(hi));
  }
}

void FuzzConvertTopk(FuzzInput& in) {
  const int64_t n = in.Range(0, 6);
  const int32_t k = in.Int32();
  std::vector<int32_t> valid_count = in.Int32s(Len(in, n));
  std::vector<int32_t> num_tokens = in.Int32s(Len(in, n));
  TableInput table;
  table.Read(in, n);
  const int32_t block_size = in.Int32();
  const int32_t num_blocks = in.Int32();
  std::vector<int32_t> topk = in.Int32s(OutSize(in, Mul(n, k)));
  const std::vector<int32_t> before = topk;
  absl::StatusOr<int64_t> invalid =
      ConvertTopk(absl::MakeSpan(topk), k, valid_count, num_tokens, table.view,
                  block_size, num_blocks);
  if (!invalid.ok()) {
    CheckRejection(invalid.status(), "ConvertTopk");
    FUZZ_CHECK(topk == before, "ConvertTopk wrote on error");
    return;
  }
  FUZZ_CHECK(*invalid >= 0 && *invalid <= static_cast<int64_t>(topk.size()),
             "invalid_count %lld", static_cast<long long>(*invalid));
  CheckAllIn(topk, 0, static_cast<int64_t>(block_size) * num_blocks, "topk");
  // The batch is valid_count's length (n only suggested it).
  for (size_t b = 0; b < valid_count.size(); ++b) {
    for (int32_t c = valid_count[b]; c < k; ++c) {
      FUZZ_CHECK(topk[b * k + c] == -1, "topk[%zu][%d] past valid_count", b, c);
    }
  }
}

SwaParams ReadSwaParams(FuzzInput& in) {
  SwaParams p;
  p.window = in.Int32();
  p.ring_size = in.Bool() ? p.window : in.Int32();
  p.num_states = in.Int32();
  return p;
}

void FuzzExpandSwaDecodeIndex(FuzzInput& in) {
  const int64_t n = in.Range(0, 6);
  std::vector<int32_t> state_ids = in.Int32s(n);
  std::vector<int32_t> starts = in.Int32s(Len(in, n));
  std::vector<int32_t> valid_lens = in.Int32s(Len(in, n));
  const SwaParams p = ReadSwaParams(in);
  std::vector<int32_t> out = in.Int32s(OutSize(in, Mul(n, p.window)));
  const std::vector<int32_t> before = out;
  const absl::Status s = ExpandSwaDecodeIndex(state_ids, starts, valid_lens, p,
                                              absl::MakeSpan(out));
  if (!s.ok()) {
    CheckRejection(s, "ExpandSwaDecodeIndex");
    FUZZ_CHECK(out == before, "ExpandSwaDecodeIndex wrote on error");
    return;
  }
  CheckAllIn(out, 0, static_cast<int64_t>(p.ring_size) * p.num_states, "out");
}

void FuzzSwaDecodeWindows(FuzzInput& in) {
  BatchInput b;
  b.Read(in);
  const SwaParams p = ReadSwaParams(in);
  const int64_t total_q = b.TotalQ();
  const int64_t rows = OutSize(in, total_q);
  std::vector<int32_t> ids(rows, 7), starts(rows, 7), lens(rows, 7);
  const absl::Status s =
      ComputeSwaDecodeWindows(b.batch, p, absl::MakeSpan(ids),
                              absl::MakeSpan(starts), absl::MakeSpan(lens));
  std::vector<int32_t> dense(OutSize(in, Mul(total_q, p.window)), 7);
  const absl::Status d = BuildSwaDecodeIndex(b.batch, p, absl::MakeSpan(dense));
  if (!s.ok()) {
    CheckRejection(s, "ComputeSwaDecodeWindows");
    FUZZ_CHECK(ids == std::vector<int32_t>(rows, 7) &&
                   starts == std::vector<int32_t>(rows, 7) &&
                   lens == std::vector<int32_t>(rows, 7),
               "ComputeSwaDecodeWindows wrote on error");
  }
  if (!d.ok()) {
    CheckRejection(d, "BuildSwaDecodeIndex");
    for (int32_t x : dense)
      FUZZ_CHECK(x == 7, "BuildSwaDecodeIndex wrote on error");
    return;
  }
  CheckAllIn(dense, 0, static_cast<int64_t>(p.ring_size) * p.num_states,
             "dense");
  if (!s.ok()) return;
  std::vector<int32_t> expanded(dense.size(), 9);
  const absl::Status e =
      ExpandSwaDecodeIndex(ids, starts, lens, p, absl::MakeSpan(expanded));
  FUZZ_CHECK(e.ok(), "the computed windows do not expand: %s",
             e.ToString().c_str());
  FUZZ_CHECK(expanded == dense, "BuildSwaDecodeIndex != Expand(Compute)");
}

void FuzzExpandSwaIndex(FuzzInput& in) {
  const int64_t rows = in.Range(0, 8);
  std::vector<int32_t> pivots = in.Int32s(Len(in, rows * kPivotFields));
  const int32_t width = in.Int32();
  const int32_t num_kv_rows = in.Int32();
  std::vector<int32_t> out = in.Int32s(
      OutSize(in, Mul(static_cast<int64_t>(pivots.size() / 4), width)));
  const std::vector<int32_t> before = out;
  const absl::Status s =
      ExpandSwaIndex(pivots, width, num_kv_rows, absl::MakeSpan(out));
  if (!s.ok()) {
    CheckRejection(s, "ExpandSwaIndex");
    FUZZ_CHECK(out == before, "ExpandSwaIndex wrote on error");
    return;
  }
  CheckAllIn(out, 0, num_kv_rows, "out");
}

void FuzzKvIndexCat(FuzzInput& in) {
  const int64_t rows = in.Bool() ? in.Range(0, 8) : in.Int64();
  const int32_t swa_width = in.Int32();
  const int32_t comp_width = in.Int32();
  std::vector<int32_t> swa = in.Int32s(Len(in, Mul(rows, swa_width)));
  std::vector<int32_t> comp = in.Int32s(Len(in, Mul(rows, comp_width)));
  const int32_t main_kv_offset = in.Int32();
  const int32_t comp_rows = in.Int32();
  const int64_t width = static_cast<int64_t>(swa_width) + comp_width;
  std::vector<int32_t> out = in.Int32s(OutSize(in, Mul(rows, width)));
  const std::vector<int32_t> before = out;
  const absl::Status s =
      KvIndexCat(swa, swa_width, comp, comp_width, rows, main_kv_offset,
                 comp_rows, absl::MakeSpan(out));
  if (!s.ok()) {
    CheckRejection(s, "KvIndexCat");
    FUZZ_CHECK(out == before, "KvIndexCat wrote on error");
    return;
  }
  CheckAllIn(out, 0, static_cast<int64_t>(main_kv_offset) + comp_rows, "out");
}

}  // namespace
}  // namespace kvdepot::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvdepot::fuzz;
  FuzzInput in(data, size);
  switch (in.Byte() % 5) {
    case 0:
      FuzzConvertTopk(in);
      break;
    case 1:
      FuzzExpandSwaDecodeIndex(in);
      break;
    case 2:
      FuzzSwaDecodeWindows(in);
      break;
    case 3:
      FuzzExpandSwaIndex(in);
      break;
    case 4:
      FuzzKvIndexCat(in);
      break;
  }
  return 0;
}
