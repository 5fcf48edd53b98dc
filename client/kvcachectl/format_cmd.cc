#include "client/kvcachectl/format_cmd.h"

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/kvcachectl/args.h"
#include "client/kvcachectl/format_fused.h"
#include "kernels/format.h"
#include "kernels/format_host.h"
#include "kernels/quant.h"
#include "kernels/reference/reference.h"
#include "kernels/store_load_host.h"

namespace kvdepot::ctl {
namespace {

const FlagSpec kOutputFlag{"output", "output format: table or json", "table"};

const CommandSpec kFormatSpec{
    "kvcachectl format (list | layout | encode | decode) ...",
    "Offline tools for the KV-cache byte contract; no daemon needed.\n"
    "  list     the supported formats and their record sizes\n"
    "  layout   the layout of one pool layer of a format\n"
    "  encode   raw BF16 values -> records, exactly as a store writes them\n"
    "  decode   records -> BF16 (or raw data and scales for index formats)\n"
    "Run `kvcachectl format COMMAND --help` for each command's flags.",
    {}};

const CommandSpec kListSpec{
    "kvcachectl format list [-o table|json]",
    "Lists the supported formats (SPEC §2). BF16(N) takes any even N >= 2.",
    {kOutputFlag}};

const CommandSpec kLayoutSpec{
    "kvcachectl format layout FORMAT [--block_size N] [--num_blocks N] "
    "[--num_layers N] [-o table|json]",
    "Prints the layout of a pool of FORMAT (V41, V41_FP4, FP4_INDEX,\n"
    "FP8_FP32SF_INDEX, MXFP8_INDEX, DS_MLA_FP8 or BF16(N)): record sizes,\n"
    "alignments, block and layer strides and the offsets of the first\n"
    "tokens.",
    {{"block_size", "token slots per block", "64"},
     {"num_blocks", "blocks per layer", "1"},
     {"num_layers", "layers in the pool", "1"},
     kOutputFlag}};

const CommandSpec kEncodeSpec = [] {
  CommandSpec spec{
      "kvcachectl format encode FORMAT --in FILE --out FILE [fused flags]",
      "Reads n x elements little-endian BF16 values and writes n records of\n"
      "bytes_per_token bytes each, every record laid out as [data | scales]\n"
      "with exactly the bytes a store writes for that token. FP4 packs "
      "element\n"
      "2i in the low nibble of byte i. With --norm_weight, --rope or\n"
      "--hadamard_len the tokens first go through the fused store's RMSNorm,\n"
      "RoPE and Hadamard (SPEC §8), bit for bit as the daemon computes them;\n"
      "--cast_back also writes the BF16 a later load returns.",
      {{"in", "input file: raw little-endian BF16, n x elements", ""},
       {"out", "output file: n records", ""}}};
  for (const FlagSpec& f : FusedEncodeFlags()) spec.flags.push_back(f);
  return spec;
}();

const CommandSpec kDecodeSpec{
    "kvcachectl format decode FORMAT --in FILE --out FILE [--scales_out FILE] "
    "[--dequantize]",
    "Reads n records ([data | scales], bytes_per_token each) and writes what\n"
    "a segment load produces: BF16 values for cast formats (V41, V41_FP4,\n"
    "DS_MLA_FP8, BF16(N)); for index formats the raw data rows to --out and\n"
    "the scales\n"
    "to --scales_out (UE8M0 bytes packed four per int32, or one fp32 per\n"
    "row). --dequantize writes BF16 values for index formats instead.",
    {{"in", "input file: n records", ""},
     {"out", "output file", ""},
     {"scales_out", "index formats: scales output file", ""},
     {"dequantize", "index formats: write dequantized BF16", "", true}}};

int Usage(std::ostream& err, const absl::Status& s, const CommandSpec& spec) {
  err << "error: " << s.message() << "\n\n" << HelpText(spec);
  return kExitUsage;
}

int Fail(std::ostream& err, const absl::Status& s) {
  err << "error: " << s.message() << "\n";
  return kExitFailed;
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::string data((std::istreambuf_iterator<char>(in)),
                   std::istreambuf_iterator<char>());
  if (in.bad()) return absl::DataLossError(absl::StrCat("cannot read ", path));
  return data;
}

absl::Status WriteFile(const std::string& path, const void* data, size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) {
    return absl::PermissionDeniedError(absl::StrCat("cannot create ", path));
  }
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

bool WantJson(const ParsedArgs& a, std::ostream& err, int* code) {
  const std::string o = a.Get("output");
  if (o != "table" && o != "json") {
    err << "error: -o must be table or json, got \"" << o << "\"\n";
    *code = kExitUsage;
  }
  return o == "json";
}

int RunList(const ParsedArgs& a, std::ostream& out, std::ostream& err) {
  int code = kExitOk;
  const bool json = WantJson(a, err, &code);
  if (code != kExitOk) return code;
  if (json) out << "[";
  if (!json) {
    out << absl::StrFormat("%-18s %-6s %-9s %-6s %-6s %-5s %-12s %s\n", "NAME",
                           "DTYPE", "ELEMENTS", "GROUP", "SF", "CAST",
                           "INTERLEAVED", "BYTES/TOKEN");
  }
  bool first = true;
  for (FormatId id : kAllFormatIds) {
    const KVCacheFormat f = *NamedFormat(id, id == FormatId::kBf16 ? 512 : 0);
    std::string name = *FormatName(f);
    std::string bytes = absl::StrCat(f.bytes_per_token());
    if (id == FormatId::kBf16) {
      name = "BF16(N)";
      bytes = "2N";
    }
    if (json) {
      out << (first ? "" : ",") << "\n  "
          << absl::StrFormat(
                 "{\"name\": \"%s\", \"quantized_dtype\": \"%s\", "
                 "\"elements\": %s, \"elements_per_sf\": %d, \"sf_format\": "
                 "\"%s\", \"do_cast\": %s, \"token_interleaved\": %s, "
                 "\"bytes_per_token\": %s}",
                 name, QuantDtypeName(f.quantized_dtype),
                 id == FormatId::kBf16 ? "\"N\"" : absl::StrCat(f.elements()),
                 f.elements_per_sf, ScaleFormatName(f.sf_format),
                 f.do_cast ? "true" : "false",
                 f.token_interleaved ? "true" : "false",
                 id == FormatId::kBf16 ? "\"2N\"" : bytes);
    } else {
      out << absl::StrFormat(
          "%-18s %-6s %-9s %-6s %-6s %-5s %-12s %s\n", name,
          QuantDtypeName(f.quantized_dtype),
          id == FormatId::kBf16 ? "N" : absl::StrCat(f.elements()),
          f.elements_per_sf == 0 ? "-" : absl::StrCat(f.elements_per_sf),
          ScaleFormatName(f.sf_format), f.do_cast ? "yes" : "no",
          f.token_interleaved ? "yes" : "no", bytes);
    }
    first = false;
  }
  if (json) out << "\n]\n";
  return kExitOk;
}

int RunLayout(const ParsedArgs& a, std::ostream& out, std::ostream& err) {
  if (a.positional().size() != 1) {
    return Usage(err, absl::InvalidArgumentError("layout takes one FORMAT"),
                 kLayoutSpec);
  }
  int code = kExitOk;
  const bool json = WantJson(a, err, &code);
  if (code != kExitOk) return code;
  absl::StatusOr<KVCacheFormat> f = FormatFromName(a.positional()[0]);
  if (!f.ok()) return Usage(err, f.status(), kLayoutSpec);
  absl::StatusOr<int64_t> bs = a.GetInt("block_size", 1, 1 << 30);
  absl::StatusOr<int64_t> nb = a.GetInt("num_blocks", 1, int64_t{1} << 40);
  absl::StatusOr<int64_t> nl = a.GetInt("num_layers", 1, 1 << 20);
  for (const absl::Status& s : {bs.status(), nb.status(), nl.status()}) {
    if (!s.ok()) return Usage(err, s, kLayoutSpec);
  }
  absl::StatusOr<PoolLayout> l = MakePoolLayout(*f, *bs, *nb, *nl);
  if (!l.ok()) return Fail(err, l.status());
  if (!json) {
    out << DescribeLayout(*l);
    return kExitOk;
  }
  const KVCacheFormat& fm = l->format;
  out << absl::StrFormat(
      "{\"format\": \"%s\", \"quantized_dtype\": \"%s\", \"elements\": %d, "
      "\"elements_per_sf\": %d, \"sf_format\": \"%s\", \"do_cast\": %s, "
      "\"token_interleaved\": %s, \"data_bytes\": %d, \"num_scales\": %d, "
      "\"sf_bytes\": %d, \"bytes_per_token\": %d, \"block_size\": %d, "
      "\"block_alignment\": %d, \"token_stride_alignment\": %d, "
      "\"block_stride\": %d, \"num_blocks\": %d, \"layer_bytes\": %d, "
      "\"layer_stride\": %d, \"num_layers\": %d, \"total_bytes\": %d, "
      "\"token0_data_offset\": %d, \"token0_scale_offset\": %d}\n",
      *FormatName(fm), QuantDtypeName(fm.quantized_dtype), fm.elements(),
      fm.elements_per_sf, ScaleFormatName(fm.sf_format),
      fm.do_cast ? "true" : "false", fm.token_interleaved ? "true" : "false",
      fm.data_bytes(), fm.num_scales(), fm.sf_bytes(), fm.bytes_per_token(),
      l->block_size, fm.block_alignment(), fm.token_stride_alignment(),
      l->block_stride, l->num_blocks, l->layer_bytes, l->layer_stride,
      l->num_layers, l->total_bytes, l->data_offset(0, 0),
      l->scale_offset(0, 0));
  return kExitOk;
}

// Reads FORMAT, --in and --out shared by encode and decode.
struct IoArgs {
  KVCacheFormat format;
  std::string input;
};

absl::StatusOr<IoArgs> ReadIo(const ParsedArgs& a) {
  if (a.positional().size() != 1) {
    return absl::InvalidArgumentError("expected exactly one FORMAT argument");
  }
  absl::StatusOr<KVCacheFormat> f = FormatFromName(a.positional()[0]);
  if (!f.ok()) return f.status();
  if (a.Get("in").empty() || a.Get("out").empty()) {
    return absl::InvalidArgumentError("--in and --out are required");
  }
  absl::StatusOr<std::string> input = ReadFile(a.Get("in"));
  if (!input.ok()) return input.status();
  return IoArgs{*f, *std::move(input)};
}

int RunEncode(const ParsedArgs& a, std::ostream& out, std::ostream& err) {
  absl::StatusOr<IoArgs> io = ReadIo(a);
  if (!io.ok()) {
    return absl::IsInvalidArgument(io.status())
               ? Usage(err, io.status(), kEncodeSpec)
               : Fail(err, io.status());
  }
  const KVCacheFormat& f = io->format;
  const size_t row = 2 * static_cast<size_t>(f.elements());
  if (io->input.size() % row != 0) {
    return Fail(err, absl::InvalidArgumentError(absl::StrFormat(
                         "--in holds %d bytes, not a multiple of one token "
                         "(%d elements x 2 bytes = %d)",
                         io->input.size(), f.elements(), row)));
  }
  if (WantsFused(a)) {
    if (absl::Status s = FusedTransform(a, f, &io->input); !s.ok()) {
      return Fail(err, s);
    }
  }
  const size_t n = io->input.size() / row;
  const size_t rec = static_cast<size_t>(f.bytes_per_token());
  std::vector<uint8_t> records(n * rec);
  std::vector<float> x(f.elements());
  const auto* in = reinterpret_cast<const uint8_t*>(io->input.data());
  for (size_t t = 0; t < n; ++t) {
    for (int32_t i = 0; i < f.elements(); ++i) {
      const uint8_t* p = in + t * row + 2 * static_cast<size_t>(i);
      x[i] = Bf16ToFloat(static_cast<uint16_t>(p[0] | (p[1] << 8)));
    }
    uint8_t* r = records.data() + t * rec;
    if (TakesBf16InputOnly(f)) {  // BF16 tails are copied bit for bit
      EncodeTokenBf16(f, in + t * row, r, r + f.data_bytes());
      continue;
    }
    EncodeToken(f, x.data(), r, r + f.data_bytes());
  }
  if (absl::Status s = WriteFile(a.Get("out"), records.data(), records.size());
      !s.ok()) {
    return Fail(err, s);
  }
  if (!a.Get("cast_back").empty()) {  // what a later load returns
    std::vector<uint8_t> cast(n * row);
    for (size_t t = 0; t < n; ++t) {
      const uint8_t* r = records.data() + t * rec;
      DecodeTokenBf16(f, r, r + f.data_bytes(), cast.data() + t * row);
    }
    if (absl::Status s =
            WriteFile(a.Get("cast_back"), cast.data(), cast.size());
        !s.ok()) {
      return Fail(err, s);
    }
  }
  err << absl::StrFormat("encoded %d tokens into %d records of %d bytes\n", n,
                         n, rec);
  (void)out;
  return kExitOk;
}

int RunDecode(const ParsedArgs& a, std::ostream& out, std::ostream& err) {
  absl::StatusOr<IoArgs> io = ReadIo(a);
  if (!io.ok()) {
    return absl::IsInvalidArgument(io.status())
               ? Usage(err, io.status(), kDecodeSpec)
               : Fail(err, io.status());
  }
  const KVCacheFormat& f = io->format;
  const bool to_bf16 = f.do_cast || a.Get("dequantize") == "true";
  if (!to_bf16 && a.Get("scales_out").empty()) {
    return Usage(err,
                 absl::InvalidArgumentError(
                     "index formats need --scales_out (or --dequantize)"),
                 kDecodeSpec);
  }
  const size_t rec = static_cast<size_t>(f.bytes_per_token());
  if (io->input.size() % rec != 0) {
    return Fail(err, absl::InvalidArgumentError(absl::StrFormat(
                         "--in holds %d bytes, not a multiple of the record "
                         "size %d",
                         io->input.size(), rec)));
  }
  const size_t n = io->input.size() / rec;
  const auto* in = reinterpret_cast<const uint8_t*>(io->input.data());
  if (to_bf16) {
    std::vector<float> x(f.elements());
    std::vector<uint8_t> bf16(n * 2 * static_cast<size_t>(f.elements()));
    for (size_t t = 0; t < n; ++t) {
      const uint8_t* r = in + t * rec;
      if (TakesBf16InputOnly(f)) {  // exactly the load's row
        DecodeTokenBf16(
            f, r, r + f.data_bytes(),
            bf16.data() + t * 2 * static_cast<size_t>(f.elements()));
        continue;
      }
      DecodeToken(f, r, r + f.data_bytes(), x.data());
      for (int32_t i = 0; i < f.elements(); ++i) {
        const uint16_t h = FloatToBf16(x[i]);
        uint8_t* p = bf16.data() + (t * f.elements() + i) * 2;
        p[0] = static_cast<uint8_t>(h & 0xFF);
        p[1] = static_cast<uint8_t>(h >> 8);
      }
    }
    if (absl::Status s = WriteFile(a.Get("out"), bf16.data(), bf16.size());
        !s.ok()) {
      return Fail(err, s);
    }
  } else {
    const size_t data_row = static_cast<size_t>(f.data_bytes());
    const size_t scale_row = static_cast<size_t>(LoadScaleRowBytes(f));
    std::vector<uint8_t> data(n * data_row);
    std::vector<uint8_t> scales(n * scale_row, 0);
    for (size_t t = 0; t < n; ++t) {
      const uint8_t* r = in + t * rec;
      std::copy(r, r + data_row, data.begin() + t * data_row);
      std::copy(r + data_row, r + rec, scales.begin() + t * scale_row);
    }
    for (const auto& [path, bytes] :
         {std::pair{a.Get("out"), &data},
          std::pair{a.Get("scales_out"), &scales}}) {
      if (absl::Status s = WriteFile(path, bytes->data(), bytes->size());
          !s.ok()) {
        return Fail(err, s);
      }
    }
  }
  err << absl::StrFormat("decoded %d records\n", n);
  (void)out;
  return kExitOk;
}

}  // namespace

int RunFormatCommand(const std::vector<std::string>& args, std::ostream& out,
                     std::ostream& err) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h" ||
      args[0] == "help") {
    (args.empty() ? err : out) << HelpText(kFormatSpec);
    return args.empty() ? kExitUsage : kExitOk;
  }
  struct Sub {
    const char* name;
    const CommandSpec* spec;
    int (*run)(const ParsedArgs&, std::ostream&, std::ostream&);
  };
  static constexpr Sub kSubs[] = {{"list", &kListSpec, RunList},
                                  {"layout", &kLayoutSpec, RunLayout},
                                  {"encode", &kEncodeSpec, RunEncode},
                                  {"decode", &kDecodeSpec, RunDecode}};
  for (const Sub& sub : kSubs) {
    if (args[0] != sub.name) continue;
    absl::StatusOr<ParsedArgs> parsed = ParseArgs(
        *sub.spec, std::vector<std::string>(args.begin() + 1, args.end()));
    if (!parsed.ok()) return Usage(err, parsed.status(), *sub.spec);
    if (parsed->help()) {
      out << HelpText(*sub.spec);
      return kExitOk;
    }
    return sub.run(*parsed, out, err);
  }
  return Usage(err,
               absl::InvalidArgumentError(
                   absl::StrCat("unknown command \"format ", args[0], "\"")),
               kFormatSpec);
}

}  // namespace kvdepot::ctl
