// kvcachectl verify: scan a pool (server-streaming Verify RPC) with a
// progress bar on a terminal and a summary at the end.
#include <unistd.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/kvcachectl/commands.h"
#include "client/kvcachectl/daemon_cmd.h"

namespace kvdepot::ctl {
namespace {

const CommandSpec kVerifySpec{
    "kvcachectl verify POOL [--layers 0,1,...] [--checksums] [flags]",
    "Scans every block of the pool (or of --layers) on the daemon's host\n"
    "for scales no encoder writes (UE8M0 255, NaN or negative E4M3/FP32)\n"
    "and NaN/Inf in the decoded data, and computes an XXH3-64 checksum per\n"
    "block and over the pool, so two scans can be compared. Exit 1 when a\n"
    "block has a problem (each one is named). A progress bar goes to a\n"
    "terminal's stderr. The scan has no deadline however large the pool\n"
    "(--timeout sets one); Ctrl-C stops it.",
    DaemonFlags({{"layers", "layers to scan, e.g. 0,2 (default: all)", ""},
                 {"checksums", "print every block's checksum", "",
                  /*is_bool=*/true},
                 {"progress_every",
                  "blocks per progress message (0: auto; at most 16384)", "0"}},
                /*streaming=*/true)};

void DrawBar(int64_t done, int64_t total, std::ostream& err) {
  constexpr int kWidth = 40;
  const int fill = total > 0 ? static_cast<int>(kWidth * done / total) : kWidth;
  err << "\r[" << std::string(fill, '#') << std::string(kWidth - fill, ' ')
      << "] " << done << "/" << total << " blocks" << std::flush;
}

}  // namespace

int RunVerifyCommand(const Args& args, std::ostream& out, std::ostream& err) {
  ParsedArgs parsed;
  DaemonCall call;
  if (int rc = ParseDaemonArgs(kVerifySpec, args, out, err, &parsed, &call);
      rc >= 0) {
    return rc;
  }
  if (parsed.positional().size() != 1) {
    return UsageError("verify takes one POOL", kVerifySpec, err);
  }
  v1::VerifyRequest r;
  r.set_pool(parsed.positional()[0]);
  int i = 0;
  for (absl::string_view part :
       absl::StrSplit(parsed.Get("layers"), ',', absl::SkipEmpty())) {
    int64_t layer;
    if (!absl::SimpleAtoi(part, &layer)) {
      return UsageError(
          absl::StrCat("--layers[", i, "] = \"", part, "\" is not an integer"),
          kVerifySpec, err);
    }
    r.add_layers(layer);
    ++i;
  }
  absl::StatusOr<int64_t> every = parsed.GetInt("progress_every", 0, INT64_MAX);
  if (!every.ok())
    return UsageError(every.status().message(), kVerifySpec, err);
  r.set_progress_every(*every);
  if (int rc = Connect(&call, err); rc >= 0) return rc;
  const bool bar = !call.structured() && isatty(STDERR_FILENO);

  std::unique_ptr<grpc::ClientContext> ctx = call.Context();
  std::unique_ptr<grpc::ClientReader<v1::VerifyProgress>> reader =
      call.client->stub()->Verify(ctx.get(), r);
  std::vector<v1::VerifyIssue> issues;
  std::vector<v1::BlockChecksum> sums;
  v1::VerifyProgress msg, last;
  while (reader->Read(&msg)) {
    for (const auto& x : msg.issues()) issues.push_back(x);
    for (const auto& x : msg.checksums()) sums.push_back(x);
    if (bar) DrawBar(msg.blocks_done(), msg.blocks_total(), err);
    if (msg.done()) last = msg;
  }
  if (bar) err << "\n";
  grpc::Status s = reader->Finish();
  if (!s.ok()) return Fail(FromGrpcStatus(s), err);
  if (!last.done()) {
    err << "error: the scan ended without a summary\n";
    return kExitFailed;
  }
  if (call.structured()) {
    Json j = Json::object();
    j["pool"] = r.pool();
    j["blocks_total"] = last.blocks_total();
    j["blocks_with_issues"] = last.blocks_with_issues();
    j["bad_scales"] = last.bad_scales();
    j["nan_values"] = last.nan_values();
    j["inf_values"] = last.inf_values();
    j["pool_xxh3"] = HashHex(last.pool_xxh3());
    j["issues"] = Json::array();
    for (const auto& x : issues) j["issues"].push_back(ProtoToJson(x));
    j["checksums"] = Json::array();
    for (const auto& x : sums) j["checksums"].push_back(ProtoToJson(x));
    PrintJson(j, call, out);
  } else {
    if (parsed.Get("checksums") == "true") {
      std::vector<std::vector<std::string>> rows = {{"LAYER", "BLOCK", "XXH3"}};
      for (const auto& x : sums) {
        rows.push_back({absl::StrCat(x.layer()), absl::StrCat(x.block()),
                        HashHex(x.xxh3())});
      }
      PrintTable(rows, out);
      out << "\n";
    }
    if (!issues.empty()) {
      std::vector<std::vector<std::string>> rows = {{"LAYER", "BLOCK", "SLOT",
                                                     "BAD_SCALES", "NAN", "INF",
                                                     "FIRST PROBLEM"}};
      for (const auto& x : issues) {
        rows.push_back({absl::StrCat(x.layer()), absl::StrCat(x.block()),
                        absl::StrCat(x.slot()), absl::StrCat(x.bad_scales()),
                        absl::StrCat(x.nan_values()),
                        absl::StrCat(x.inf_values()), x.detail()});
      }
      PrintTable(rows, out);
      out << "\n";
    }
    PrintTable(
        {{"pool:", r.pool()},
         {"blocks:", absl::StrCat(last.blocks_done(), " scanned, ",
                                  last.blocks_with_issues(), " with problems")},
         {"problems:",
          absl::StrCat(last.bad_scales(), " bad scales, ", last.nan_values(),
                       " NaN, ", last.inf_values(), " Inf")},
         {"checksum:", absl::StrCat("xxh3 ", HashHex(last.pool_xxh3()))}},
        out);
  }
  if (last.blocks_with_issues() > 0) {
    err << "verify: " << last.blocks_with_issues()
        << " block(s) with problems in pool " << r.pool() << "\n";
    return kExitFailed;
  }
  return kExitOk;
}

}  // namespace kvdepot::ctl
