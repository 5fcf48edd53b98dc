// Host-side helpers of the byte contract: validated construction of
// KVCacheFormat and PoolLayout, the named formats of SPEC §2 by id and name
// (their constants are in named_formats.h), and resolution of a format from
// a byte width.
#ifndef KVDEPOT_KERNELS_FORMAT_HOST_H_
#define KVDEPOT_KERNELS_FORMAT_HOST_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/format.h"
#include "kernels/named_formats.h"

namespace kvdepot {

// Validates the field rules of SPEC §2; the message names the failing rule.
absl::Status ValidateFormat(const KVCacheFormat& format);

// Builds a format from its fields, or fails with ValidateFormat's error.
absl::StatusOr<KVCacheFormat> MakeFormat(
    QuantDtype dtype, int32_t quantized_elements, int32_t elements_per_sf,
    int32_t bf16_elements, bool do_cast, ScaleFormat sf_format,
    bool token_interleaved,
    ScaleRounding scale_rounding = ScaleRounding::kNone);

// A named format. bf16_elements is required for kBf16 (even, >= 2) and must
// be 0 otherwise.
absl::StatusOr<KVCacheFormat> NamedFormat(FormatId id,
                                          int32_t bf16_elements = 0);

// Parses "V41", "V41_FP4", "FP4_INDEX", "FP8_FP32SF_INDEX", "MXFP8_INDEX",
// "DS_MLA_FP8" or "BF16(N)" (case-insensitive).
absl::StatusOr<KVCacheFormat> FormatFromName(absl::string_view name);

// The name of a format ("BF16(N)" for BF16) or an error if it is not one of
// the supported formats.
absl::StatusOr<std::string> FormatName(const KVCacheFormat& format);
std::optional<FormatId> IdentifyFormat(const KVCacheFormat& format);

absl::string_view ScaleFormatName(ScaleFormat f);
absl::string_view QuantDtypeName(QuantDtype d);
absl::StatusOr<ScaleFormat> ScaleFormatFromName(absl::string_view name);
absl::string_view ScaleRoundingName(ScaleRounding r);  // "none", "pow2_ceil"
absl::StatusOr<ScaleRounding> ScaleRoundingFromName(absl::string_view name);

// Resolves a supported format from its bytes_per_token and an optional
// sf_format hint. BF16 records of width w resolve to BF16(w / 2) only when no
// quantized format matches. Ambiguity is INVALID_ARGUMENT naming every
// candidate; no match is NOT_FOUND listing the supported widths.
absl::StatusOr<KVCacheFormat> ResolveFormat(
    int64_t bytes_per_token, std::optional<ScaleFormat> sf_hint = std::nullopt);

// Validated layout: block_size, num_blocks, num_layers > 0 and every size
// fits in int64 (pools beyond 4 GiB are fine).
absl::StatusOr<PoolLayout> MakePoolLayout(const KVCacheFormat& format,
                                          int64_t block_size,
                                          int64_t num_blocks,
                                          int64_t num_layers);

// Multi-line human-readable description of a layout (for CLIs and logs).
std::string DescribeLayout(const PoolLayout& layout);

}  // namespace kvdepot

#endif  // KVDEPOT_KERNELS_FORMAT_HOST_H_
