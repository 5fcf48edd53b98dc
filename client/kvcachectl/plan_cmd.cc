// kvcachectl plan: BuildPlan from a sequence description; prints segments.
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/kvcachectl/commands.h"
#include "client/kvcachectl/daemon_cmd.h"
#include "common/status_macros.h"
#include "proto/wire.h"

namespace kvdepot::ctl {
namespace {

const CommandSpec kPlanSpec{
    "kvcachectl plan POOL (--seqlens L,... --block_table B,...;B,... | "
    "--file plan.json) [flags]",
    "Builds the load plan of SPEC §5/§6 for sequences on POOL (BuildPlan)\n"
    "and prints its segments {src_block, src_begin, src_end, dst_offset}\n"
    "and each sequence's first output row. The JSON file:\n"
    "  {\"seqlen_k\": [5, 9], \"block_table\": [[0, 1], [2, 3]],\n"
    "   \"compress_ratio\": 1}\n"
    "Block-table rows are separated by ';' on the command line.",
    DaemonFlags({{"seqlens", "logical tokens per sequence, e.g. 5,9", ""},
                 {"block_table", "rows of block ids, e.g. 0,1;2,3", ""},
                 {"compress_ratio", "compression ratio R >= 1", "1"},
                 {"file",
                  "JSON file with seqlen_k, block_table, "
                  "compress_ratio",
                  ""}})};

struct Sequences {
  std::vector<int32_t> seqlen_k;
  std::vector<std::vector<int32_t>> block_table;
  int64_t compress_ratio = 1;
};

absl::Status ParseInts(absl::string_view field, absl::string_view text,
                       std::vector<int32_t>* out) {
  int i = 0;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int32_t v;
    if (!absl::SimpleAtoi(part, &v)) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, "[", i, "] = \"", part, "\" is not a 32-bit integer"));
    }
    out->push_back(v);
    ++i;
  }
  return absl::OkStatus();
}

absl::StatusOr<int32_t> JsonInt(absl::string_view field,
                                const google::protobuf::Value& v) {
  if (v.kind_case() != google::protobuf::Value::kNumberValue ||
      v.number_value() != std::floor(v.number_value()) ||
      std::abs(v.number_value()) > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " is not a 32-bit integer"));
  }
  return static_cast<int32_t>(v.number_value());
}

absl::StatusOr<std::vector<int32_t>> JsonInts(
    absl::string_view field, const google::protobuf::Value& v) {
  if (v.kind_case() != google::protobuf::Value::kListValue) {
    return absl::InvalidArgumentError(absl::StrCat(field, " is not a list"));
  }
  std::vector<int32_t> out;
  for (int i = 0; i < v.list_value().values_size(); ++i) {
    absl::StatusOr<int32_t> x =
        JsonInt(absl::StrCat(field, "[", i, "]"), v.list_value().values(i));
    if (!x.ok()) return x.status();
    out.push_back(*x);
  }
  return out;
}

absl::Status FromJsonFile(const std::string& path, Sequences* s) {
  std::ifstream in(path);
  if (!in)
    return absl::NotFoundError(absl::StrCat("cannot read \"", path, "\""));
  std::stringstream text;
  text << in.rdbuf();
  google::protobuf::Struct root;
  if (!google::protobuf::util::JsonStringToMessage(text.str(), &root).ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("\"", path, "\" is not a JSON object"));
  }
  const auto& f = root.fields();
  for (const auto& [key, value] : f) {
    if (key != "seqlen_k" && key != "block_table" && key != "compress_ratio") {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": unknown field \"", key, "\""));
    }
  }
  if (!f.contains("seqlen_k") || !f.contains("block_table")) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": seqlen_k and block_table are required"));
  }
  absl::StatusOr<std::vector<int32_t>> lens =
      JsonInts("seqlen_k", f.at("seqlen_k"));
  if (!lens.ok()) return lens.status();
  s->seqlen_k = *lens;
  const google::protobuf::Value& bt = f.at("block_table");
  if (bt.kind_case() != google::protobuf::Value::kListValue) {
    return absl::InvalidArgumentError("block_table is not a list of lists");
  }
  for (int i = 0; i < bt.list_value().values_size(); ++i) {
    absl::StatusOr<std::vector<int32_t>> row = JsonInts(
        absl::StrCat("block_table[", i, "]"), bt.list_value().values(i));
    if (!row.ok()) return row.status();
    s->block_table.push_back(*row);
  }
  if (f.contains("compress_ratio")) {
    absl::StatusOr<int32_t> r =
        JsonInt("compress_ratio", f.at("compress_ratio"));
    if (!r.ok()) return r.status();
    s->compress_ratio = *r;
  }
  return absl::OkStatus();
}

absl::Status FromFlags(const ParsedArgs& p, Sequences* s) {
  if (!p.Has("seqlens") || !p.Has("block_table")) {
    return absl::InvalidArgumentError(
        "--seqlens and --block_table (or --file) are required");
  }
  RETURN_IF_ERROR(ParseInts("--seqlens", p.Get("seqlens"), &s->seqlen_k));
  int i = 0;
  for (absl::string_view row : absl::StrSplit(p.Get("block_table"), ';')) {
    s->block_table.emplace_back();
    RETURN_IF_ERROR(ParseInts(absl::StrCat("--block_table row ", i), row,
                              &s->block_table.back()));
    ++i;
  }
  absl::StatusOr<int64_t> r = p.GetInt("compress_ratio", 1, INT32_MAX);
  if (!r.ok()) return r.status();
  s->compress_ratio = *r;
  return absl::OkStatus();
}

}  // namespace

int RunPlanCommand(const Args& args, std::ostream& out, std::ostream& err) {
  ParsedArgs parsed;
  DaemonCall call;
  if (int rc = ParseDaemonArgs(kPlanSpec, args, out, err, &parsed, &call);
      rc >= 0) {
    return rc;
  }
  if (parsed.positional().size() != 1) {
    return UsageError("plan takes one POOL", kPlanSpec, err);
  }
  Sequences seqs;
  absl::Status st = parsed.Has("file") ? FromJsonFile(parsed.Get("file"), &seqs)
                                       : FromFlags(parsed, &seqs);
  if (!st.ok()) return UsageError(st.message(), kPlanSpec, err);
  if (seqs.block_table.size() != seqs.seqlen_k.size()) {
    return UsageError(
        absl::StrCat("block_table has ", seqs.block_table.size(), " rows for ",
                     seqs.seqlen_k.size(), " sequences"),
        kPlanSpec, err);
  }
  size_t width = 1;
  for (const auto& row : seqs.block_table) width = std::max(width, row.size());
  std::vector<int32_t> table;
  for (const auto& row : seqs.block_table) {
    table.insert(table.end(), row.begin(), row.end());
    table.insert(table.end(), width - row.size(), 0);  // never read
  }
  v1::BuildPlanRequest r;
  r.set_pool(parsed.positional()[0]);
  v1::SequencePlan* sp = r.mutable_sequences();
  sp->set_num_seqs(static_cast<int64_t>(seqs.seqlen_k.size()));
  EncodeInt32s(seqs.seqlen_k, sp->mutable_seqlen_k());
  sp->set_max_blocks_per_seq(static_cast<int64_t>(width));
  EncodeInt32s(table, sp->mutable_block_table());
  sp->set_compress_ratio(static_cast<int32_t>(seqs.compress_ratio));
  if (int rc = Connect(&call, err); rc >= 0) return rc;
  absl::StatusOr<v1::BuildPlanResponse> plan = call.client->BuildPlan(r);
  if (!plan.ok()) return Fail(plan.status(), err);
  const std::vector<int32_t> segs = ReadInt32s(plan->plan().segments());
  const std::vector<int32_t> cu = ReadInt32s(plan->cu_rows());
  if (call.structured()) {
    Json rows = Json::array();
    for (size_t i = 0; i + 3 < segs.size(); i += 4) {
      rows.push_back({segs[i], segs[i + 1], segs[i + 2], segs[i + 3]});
    }
    Json j = Json::object();
    j["total_k"] = plan->plan().total_k();
    j["num_segments"] = plan->plan().num_segments();
    j["segments"] = std::move(rows);
    j["cu_rows"] = cu;
    PrintJson(j, call, out);
    return kExitOk;
  }
  std::vector<std::vector<std::string>> rows = {
      {"SEGMENT", "SRC_BLOCK", "SRC_BEGIN", "SRC_END", "DST_OFFSET", "ROWS"}};
  for (size_t i = 0; i + 3 < segs.size(); i += 4) {
    rows.push_back(
        {absl::StrCat(i / 4), segs[i] < 0 ? "zero" : absl::StrCat(segs[i]),
         absl::StrCat(segs[i + 1]), absl::StrCat(segs[i + 2]),
         absl::StrCat(segs[i + 3]), absl::StrCat(segs[i + 2] - segs[i + 1])});
  }
  PrintTable(rows, out);
  out << "\ntotal_k: " << plan->plan().total_k()
      << "\ncu_rows: " << absl::StrJoin(cu, ",") << "\n";
  return kExitOk;
}

}  // namespace kvdepot::ctl
