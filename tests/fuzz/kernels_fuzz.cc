// The byte contract's validators and the CPU reference engine (kernels/,
// kernels/reference/): a format (named, built from fields, or parsed from a
// name), a pool layout, then Store and LoadSegments on a small pool layer,
// and EncodeToken/DecodeToken of one token.
// Properties: no crash or sanitizer report; a rejected Store leaves the
// layer byte-identical, a rejected load leaves the outputs alone; errors are
// INVALID_ARGUMENT (UNIMPLEMENTED for a format without quantization math).
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/format.h"
#include "kernels/format_host.h"
#include "kernels/named_formats.h"
#include "kernels/reference/reference.h"
#include "kernels/store_load.h"
#include "kernels/store_load_host.h"
#include "tests/fuzz/fuzz_input.h"

namespace kvdepot::fuzz {
namespace {

constexpr int64_t kMaxBytes = int64_t{1} << 20;  // pool layer, outputs

void CheckRejected(const absl::Status& s, const char* what) {
  FUZZ_CHECK(s.code() == absl::StatusCode::kInvalidArgument ||
                 s.code() == absl::StatusCode::kUnimplemented,
             "%s: %s", what, s.ToString().c_str());
}

absl::StatusOr<KVCacheFormat> ReadFormat(FuzzInput& in) {
  switch (in.Byte() % 4) {
    case 0: {
      const auto id = static_cast<FormatId>(in.Range(0, 6));
      const int32_t bf16 = in.Int32();
      return NamedFormat(id, bf16);
    }
    case 1: {
      const auto dtype = static_cast<QuantDtype>(in.Range(0, 3));
      const int32_t elements = in.Int32();
      const int32_t per_sf = in.Int32();
      const int32_t bf16 = in.Int32();
      const bool do_cast = in.Bool();
      const auto sf = static_cast<ScaleFormat>(in.Range(0, 4));
      const bool interleaved = in.Bool();
      return MakeFormat(dtype, elements, per_sf, bf16, do_cast, sf,
                        interleaved);
    }
    case 2:
      return FormatFromName(in.Bytes(24));
    default: {
      const int64_t bytes_per_token = in.Int64();
      if (in.Bool()) return ResolveFormat(bytes_per_token);
      return ResolveFormat(bytes_per_token,
                           static_cast<ScaleFormat>(in.Range(0, 4)));
    }
  }
}

// Bytes of fuzz input as `n` values of `dtype` (zero padded).
std::string ReadValues(FuzzInput& in, int64_t n, InputDtype dtype) {
  std::string v = in.Bytes(static_cast<size_t>(n) * 4);
  v.resize(static_cast<size_t>(n) * (dtype == InputDtype::kFP32 ? 4 : 2), '\0');
  return v;
}

void FuzzStoreLoad(FuzzInput& in, const KVCacheFormat& format) {
  const int64_t block_size = in.Int64();
  const int64_t num_blocks = in.Int64();
  const int64_t num_layers = in.Bool() ? 1 : in.Int64();
  absl::StatusOr<PoolLayout> l =
      MakePoolLayout(format, block_size, num_blocks, num_layers);
  if (!l.ok()) {
    CheckRejected(l.status(), "MakePoolLayout");
    return;
  }
  FUZZ_CHECK(l->layer_bytes == l->num_blocks * l->block_stride &&
                 l->total_bytes == l->num_layers * l->layer_stride &&
                 l->layer_stride >= l->layer_bytes,
             "inconsistent layout");
  const bool has_math = ValidateQuantization(format).ok();
  if (l->layer_bytes > kMaxBytes || !has_math) return;
  std::vector<uint8_t> layer(l->layer_bytes);
  for (size_t i = 0; i < layer.size(); ++i)
    layer[i] = static_cast<uint8_t>(i * 131);

  // Store: mostly valid slots, sometimes duplicates or out of range.
  const int64_t n = in.Range(0, 8);
  const std::vector<int32_t> slots = in.Int32s(n);
  const auto dtype = static_cast<InputDtype>(in.Range(0, 1));
  const std::string kv = ReadValues(in, n * format.elements(), dtype);
  const std::vector<uint8_t> before = layer;
  const absl::Status s = Store(*l, layer.data(), kv.data(), dtype, slots);
  if (!s.ok()) {
    CheckRejected(s, "Store");
    FUZZ_CHECK(layer == before, "a rejected Store wrote to the pool");
  }

  // Segment load into outputs of total_k rows.
  const std::vector<int32_t> segments = in.Int32s(4 * in.Range(0, 6));
  const int64_t total_k = in.Bool() ? in.Range(0, 64) : in.Int64();
  const int64_t data_row = LoadDataRowBytes(format);
  const int64_t scale_row = LoadScaleRowBytes(format);
  if (total_k < 0 || total_k > 4096 ||
      total_k * (data_row + scale_row) > kMaxBytes) {
    // Too large to allocate: only the validation runs.
    const absl::Status v = ValidateSegments(*l, segments, total_k);
    if (!v.ok()) CheckRejected(v, "ValidateSegments");
    return;
  }
  std::vector<uint8_t> data(total_k * data_row, 0xAB);
  std::vector<uint8_t> scales(total_k * scale_row, 0xCD);
  const absl::Status t =
      LoadSegments(*l, layer.data(), segments, total_k, data.data(),
                   scales.empty() ? nullptr : scales.data());
  if (!t.ok()) {
    CheckRejected(t, "LoadSegments");
    for (uint8_t b : data) FUZZ_CHECK(b == 0xAB, "a rejected load wrote data");
    for (uint8_t b : scales)
      FUZZ_CHECK(b == 0xCD, "a rejected load wrote scales");
  }
}

void FuzzToken(FuzzInput& in, const KVCacheFormat& format) {
  if (!ValidateQuantization(format).ok() || format.elements() > 4096) return;
  std::vector<float> x(format.elements());
  const std::string bytes = in.Bytes(x.size() * 4);
  std::memcpy(x.data(), bytes.data(), bytes.size());  // NaN, Inf, denormals
  std::vector<uint8_t> data(format.data_bytes() + 1, 0xEE);
  // A BF16 tail (DS_MLA_FP8) follows the scales, as in the record.
  std::vector<uint8_t> scales(format.sf_bytes() + format.tail_bytes() + 1,
                              0xEE);
  EncodeToken(format, x.data(), data.data(), scales.data());
  FUZZ_CHECK(data.back() == 0xEE && scales.back() == 0xEE,
             "EncodeToken wrote past data_bytes or sf_bytes + tail_bytes");
  std::vector<float> out(format.elements() + 1, 1.5f);
  DecodeToken(format, data.data(), scales.data(), out.data());
  FUZZ_CHECK(out.back() == 1.5f, "DecodeToken wrote past elements()");
}

}  // namespace
}  // namespace kvdepot::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvdepot::fuzz;
  FuzzInput in(data, size);
  absl::StatusOr<kvdepot::KVCacheFormat> f = ReadFormat(in);
  if (!f.ok()) {
    // ResolveFormat: NOT_FOUND when no format has that record size.
    if (f.status().code() != absl::StatusCode::kNotFound) {
      CheckRejected(f.status(), "format");
    }
    return 0;
  }
  const absl::Status v = kvdepot::ValidateFormat(*f);
  FUZZ_CHECK(v.ok(),
             "a format the constructors accept fails ValidateFormat: %s",
             v.ToString().c_str());
  absl::StatusOr<std::string> name = kvdepot::FormatName(*f);
  if (name.ok()) {
    absl::StatusOr<kvdepot::KVCacheFormat> again =
        kvdepot::FormatFromName(*name);
    FUZZ_CHECK(again.ok(), "FormatName %s does not parse back", name->c_str());
  }
  if (in.Bool()) {
    FuzzStoreLoad(in, *f);
  } else {
    FuzzToken(in, *f);
  }
  return 0;
}
