// kvcachectl pool list | get NAME | create NAME ... | delete NAME
#include "absl/strings/str_cat.h"
#include "client/kvcachectl/commands.h"
#include "client/kvcachectl/daemon_cmd.h"

namespace kvdepot::ctl {
namespace {

const CommandSpec kPoolSpec{
    "kvcachectl pool (list | get NAME | create NAME ... | delete NAME)",
    "Manage the daemon's pools. Run `kvcachectl pool SUBCOMMAND --help`.",
    {}};

const CommandSpec kListSpec{"kvcachectl pool list [flags]",
                            "Lists the pools, sorted by name.",
                            DaemonFlags({})};

const CommandSpec kGetSpec{
    "kvcachectl pool get NAME [flags]",
    "Shows one pool: device, layout (every size and stride) and how clients "
    "map it.",
    DaemonFlags({})};

const CommandSpec kCreateSpec{
    "kvcachectl pool create NAME --format F --block_size N --num_blocks N "
    "--num_layers N [flags]",
    "Creates a pool. Formats: V41, V41_FP4, DS_MLA_FP8, FP4_INDEX,\n"
    "FP8_FP32SF_INDEX, MXFP8_INDEX, BF16 (with --elements) or BF16(N).",
    DaemonFlags({{"format", "format name (SPEC §2)", ""},
                 {"elements", "elements per token, BF16 only", "0"},
                 {"block_size", "token slots per block", ""},
                 {"num_blocks", "blocks per layer", ""},
                 {"num_layers", "layers", ""},
                 {"device", "cpu or cuda:N (default: the backend's)", ""}})};

const CommandSpec kDeleteSpec{
    "kvcachectl pool delete NAME [flags]",
    "Deletes a pool (its memory is freed once in-flight requests finish).",
    DaemonFlags({})};

std::vector<std::string> PoolRow(const v1::PoolInfo& p) {
  return {p.name(),
          p.layout().format(),
          p.device(),
          absl::StrCat(p.layout().num_layers()),
          absl::StrCat(p.layout().num_blocks()),
          absl::StrCat(p.layout().block_size()),
          absl::StrCat(p.layout().bytes_per_token()),
          HumanBytes(p.layout().total_bytes())};
}

const std::vector<std::string> kPoolHeader = {
    "NAME",   "FORMAT",     "DEVICE",    "LAYERS",
    "BLOCKS", "BLOCK_SIZE", "BYTES/TOK", "SIZE"};

void PrintPool(const v1::PoolInfo& p, std::ostream& out) {
  const v1::PoolLayout& l = p.layout();
  std::vector<std::vector<std::string>> rows = {
      {"name:", p.name()},
      {"device:", p.device()},
      {"format:", l.format()},
      {"quantized:",
       absl::StrCat(l.quantized_dtype(), ", ", l.elements(), " elements, ",
                    l.elements_per_sf(), " per scale, scale ", l.sf_format())},
      {"record:", absl::StrCat(l.bytes_per_token(), " B (data ", l.data_bytes(),
                               " + scales ", l.sf_bytes(), "), ",
                               l.token_interleaved() ? "token-interleaved"
                                                     : "block-split")},
      {"blocks:", absl::StrCat(l.num_layers(), " layers x ", l.num_blocks(),
                               " blocks x ", l.block_size(), " slots")},
      {"strides:", absl::StrCat("block ", l.block_stride(), " B, layer ",
                                l.layer_stride(), " B")},
      {"size:",
       absl::StrCat(l.total_bytes(), " B (", HumanBytes(l.total_bytes()), ")")},
      {"load rows:", absl::StrCat(l.load_data_row_bytes(), " B data + ",
                                  l.load_scale_row_bytes(), " B scales")},
  };
  if (p.handle().kind_case() == v1::SharedHandle::kShmName) {
    rows.push_back({"shm:", p.handle().shm_name()});
  }
  PrintTable(rows, out);
}

int List(const Args& args, std::ostream& out, std::ostream& err) {
  ParsedArgs parsed;
  DaemonCall call;
  if (int rc = ParseDaemonArgs(kListSpec, args, out, err, &parsed, &call);
      rc >= 0) {
    return rc;
  }
  if (!parsed.positional().empty()) {
    return UsageError("pool list takes no arguments", kListSpec, err);
  }
  if (int rc = Connect(&call, err); rc >= 0) return rc;
  absl::StatusOr<v1::ListPoolsResponse> pools = call.client->ListPools();
  if (!pools.ok()) return Fail(pools.status(), err);
  if (call.structured()) {
    PrintProto(*pools, call, out);
    return kExitOk;
  }
  std::vector<std::vector<std::string>> rows = {kPoolHeader};
  for (const v1::PoolInfo& p : pools->pools()) rows.push_back(PoolRow(p));
  PrintTable(rows, out);
  return kExitOk;
}

int Get(const Args& args, std::ostream& out, std::ostream& err) {
  ParsedArgs parsed;
  DaemonCall call;
  if (int rc = ParseDaemonArgs(kGetSpec, args, out, err, &parsed, &call);
      rc >= 0) {
    return rc;
  }
  if (parsed.positional().size() != 1) {
    return UsageError("pool get takes one pool NAME", kGetSpec, err);
  }
  if (int rc = Connect(&call, err); rc >= 0) return rc;
  absl::StatusOr<v1::PoolInfo> pool =
      call.client->GetPool(parsed.positional()[0]);
  if (!pool.ok()) return Fail(pool.status(), err);
  if (call.structured()) {
    PrintProto(*pool, call, out);
  } else {
    PrintPool(*pool, out);
  }
  return kExitOk;
}

int Create(const Args& args, std::ostream& out, std::ostream& err) {
  ParsedArgs parsed;
  DaemonCall call;
  if (int rc = ParseDaemonArgs(kCreateSpec, args, out, err, &parsed, &call);
      rc >= 0) {
    return rc;
  }
  if (parsed.positional().size() != 1) {
    return UsageError("pool create takes one pool NAME", kCreateSpec, err);
  }
  v1::CreatePoolRequest r;
  r.set_name(parsed.positional()[0]);
  r.set_format(parsed.Get("format"));
  r.set_device(parsed.Get("device"));
  if (r.format().empty()) {
    return UsageError("--format is required", kCreateSpec, err);
  }
  struct IntFlag {
    const char* name;
    int64_t min, max;
    int64_t* value;
  };
  int64_t elements = 0, block_size = 0, num_blocks = 0, num_layers = 0;
  for (IntFlag f : {IntFlag{"elements", 0, INT32_MAX, &elements},
                    IntFlag{"block_size", 1, INT64_MAX, &block_size},
                    IntFlag{"num_blocks", 1, INT64_MAX, &num_blocks},
                    IntFlag{"num_layers", 1, INT64_MAX, &num_layers}}) {
    if (f.min > 0 && !parsed.Has(f.name)) {
      return UsageError(absl::StrCat("--", f.name, " is required"), kCreateSpec,
                        err);
    }
    absl::StatusOr<int64_t> v = parsed.GetInt(f.name, f.min, f.max);
    if (!v.ok()) return UsageError(v.status().message(), kCreateSpec, err);
    *f.value = *v;
  }
  r.set_elements(static_cast<int32_t>(elements));
  r.set_block_size(block_size);
  r.set_num_blocks(num_blocks);
  r.set_num_layers(num_layers);
  if (int rc = Connect(&call, err); rc >= 0) return rc;
  absl::StatusOr<v1::PoolInfo> pool = call.client->CreatePool(r);
  if (!pool.ok()) return Fail(pool.status(), err);
  if (call.structured()) {
    PrintProto(*pool, call, out);
  } else {
    out << "pool \"" << pool->name() << "\" created\n";
    PrintPool(*pool, out);
  }
  return kExitOk;
}

int Delete(const Args& args, std::ostream& out, std::ostream& err) {
  ParsedArgs parsed;
  DaemonCall call;
  if (int rc = ParseDaemonArgs(kDeleteSpec, args, out, err, &parsed, &call);
      rc >= 0) {
    return rc;
  }
  if (parsed.positional().size() != 1) {
    return UsageError("pool delete takes one pool NAME", kDeleteSpec, err);
  }
  if (int rc = Connect(&call, err); rc >= 0) return rc;
  const std::string& name = parsed.positional()[0];
  if (absl::Status s = call.client->DeletePool(name); !s.ok()) {
    return Fail(s, err);
  }
  if (call.structured()) {
    PrintJson(Json{{"deleted", name}}, call, out);
  } else {
    out << "pool \"" << name << "\" deleted\n";
  }
  return kExitOk;
}

}  // namespace

int RunPoolCommand(const Args& args, std::ostream& out, std::ostream& err) {
  if (args.empty())
    return UsageError("missing pool subcommand", kPoolSpec, err);
  const std::string& sub = args[0];
  const Args rest(args.begin() + 1, args.end());
  if (sub == "--help" || sub == "-h") {
    out << HelpText(kPoolSpec);
    return kExitOk;
  }
  if (sub == "list" || sub == "ls") return List(rest, out, err);
  if (sub == "get") return Get(rest, out, err);
  if (sub == "create") return Create(rest, out, err);
  if (sub == "delete" || sub == "rm") return Delete(rest, out, err);
  return UsageError(absl::StrCat("unknown pool subcommand \"", sub, "\""),
                    kPoolSpec, err);
}

}  // namespace kvdepot::ctl
