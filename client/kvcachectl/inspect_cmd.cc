// kvcachectl inspect: decoded records of one slot or block (Inspect RPC).
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/kvcachectl/commands.h"
#include "client/kvcachectl/daemon_cmd.h"

namespace kvdepot::ctl {
namespace {

const CommandSpec kInspectSpec{
    "kvcachectl inspect POOL --layer L (--slot S | --block B) [flags]",
    "Reads token records of a pool on the daemon's host and decodes them:\n"
    "scales (raw bytes and values), the first --values dequantized values\n"
    "(all with --all), NaN/Inf counts, and scales no encoder writes\n"
    "(UE8M0 255, NaN or negative E4M3/FP32), marked BAD.",
    DaemonFlags({{"layer", "layer", ""},
                 {"slot", "one slot (block * block_size + offset)", ""},
                 {"block", "every slot of one block", ""},
                 {"values", "dequantized values shown per record", "8"},
                 {"all", "show every value", "", /*is_bool=*/true}})};

std::string Num(float v) { return absl::StrFormat("%g", v); }

}  // namespace

int RunInspectCommand(const Args& args, std::ostream& out, std::ostream& err) {
  ParsedArgs parsed;
  DaemonCall call;
  if (int rc = ParseDaemonArgs(kInspectSpec, args, out, err, &parsed, &call);
      rc >= 0) {
    return rc;
  }
  if (parsed.positional().size() != 1) {
    return UsageError("inspect takes one POOL", kInspectSpec, err);
  }
  if (!parsed.Has("layer")) {
    return UsageError("--layer is required", kInspectSpec, err);
  }
  if (parsed.Has("slot") == parsed.Has("block")) {
    return UsageError("give exactly one of --slot and --block", kInspectSpec,
                      err);
  }
  v1::InspectRequest r;
  r.set_pool(parsed.positional()[0]);
  // Ranges are the daemon's to check (it knows the pool); here only syntax.
  absl::StatusOr<int64_t> layer = parsed.GetInt("layer", INT64_MIN, INT64_MAX);
  absl::StatusOr<int64_t> values = parsed.GetInt("values", 0, INT32_MAX);
  if (!layer.ok())
    return UsageError(layer.status().message(), kInspectSpec, err);
  if (!values.ok()) {
    return UsageError(values.status().message(), kInspectSpec, err);
  }
  r.set_layer(*layer);
  r.set_max_values(static_cast<int32_t>(*values));
  r.set_all_values(parsed.Get("all") == "true");
  const char* target = parsed.Has("slot") ? "slot" : "block";
  absl::StatusOr<int64_t> t = parsed.GetInt(target, INT64_MIN, INT64_MAX);
  if (!t.ok()) return UsageError(t.status().message(), kInspectSpec, err);
  if (parsed.Has("slot")) {
    r.set_slot(*t);
  } else {
    r.set_block(*t);
  }
  if (int rc = Connect(&call, err); rc >= 0) return rc;
  v1::InspectResponse resp;
  std::unique_ptr<grpc::ClientContext> ctx = call.Context();
  grpc::Status s = call.client->stub()->Inspect(ctx.get(), r, &resp);
  if (!s.ok()) return Fail(FromGrpcStatus(s), err);
  if (call.structured()) {
    PrintProto(resp, call, out);
    return kExitOk;
  }
  const v1::PoolLayout& l = resp.layout();
  out << "pool " << r.pool() << " layer " << resp.layer() << ": " << l.format()
      << ", " << l.bytes_per_token() << " B/record, scale " << l.sf_format()
      << "\n";
  std::vector<std::vector<std::string>> rows = {{"SLOT", "BLOCK", "OFF",
                                                 "SCALES(hex)", "SCALES", "NAN",
                                                 "INF", "BAD_SF", "VALUES"}};
  for (const v1::InspectRecord& rec : resp.records()) {
    std::vector<std::string> scales, vals;
    for (float f : rec.scales()) scales.push_back(Num(f));
    for (float f : rec.values()) vals.push_back(Num(f));
    std::string flag =
        rec.bad_scales() > 0 ? absl::StrCat(rec.bad_scales(), " BAD") : "0";
    rows.push_back({absl::StrCat(rec.slot()), absl::StrCat(rec.block()),
                    absl::StrCat(rec.offset()),
                    rec.scale_hex().empty() ? "-" : rec.scale_hex(),
                    scales.empty() ? "-" : absl::StrJoin(scales, ","),
                    absl::StrCat(rec.nan_count()),
                    absl::StrCat(rec.inf_count()), flag,
                    rec.all_zero() ? "(all zero)" : absl::StrJoin(vals, " ")});
  }
  PrintTable(rows, out);
  return kExitOk;
}

}  // namespace kvdepot::ctl
