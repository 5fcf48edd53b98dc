// The format descriptor of SPEC §2: validation rules (each rejected with a
// message naming it), derived sizes, names, and resolution from a width.
#include "kernels/format.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/format_host.h"

namespace kvdepot {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

using Q = QuantDtype;
using S = ScaleFormat;

TEST(FormatTest, NamedFormatsHaveSpecSizes) {
  struct Expect {
    const char* name;
    int32_t quantized_bytes, scales, sf_bytes, bytes, data_bytes;
  };
  for (const Expect& e : {Expect{"V41", 512, 16, 16, 528, 512},
                          Expect{"V41_FP4", 256, 32, 32, 288, 256},
                          Expect{"FP4_INDEX", 64, 4, 4, 68, 64},
                          Expect{"FP8_FP32SF_INDEX", 128, 1, 4, 132, 128},
                          Expect{"MXFP8_INDEX", 128, 4, 4, 132, 128},
                          Expect{"BF16(512)", 0, 0, 0, 1024, 1024},
                          Expect{"BF16(2)", 0, 0, 0, 4, 4}}) {
    absl::StatusOr<KVCacheFormat> f = FormatFromName(e.name);
    ASSERT_TRUE(f.ok()) << e.name << ": " << f.status();
    EXPECT_EQ(f->quantized_bytes(), e.quantized_bytes) << e.name;
    EXPECT_EQ(f->num_scales(), e.scales) << e.name;
    EXPECT_EQ(f->sf_bytes(), e.sf_bytes) << e.name;
    EXPECT_EQ(f->bytes_per_token(), e.bytes) << e.name;
    EXPECT_EQ(f->data_bytes(), e.data_bytes) << e.name;
    EXPECT_TRUE(ValidateFormat(*f).ok());
  }
}

TEST(FormatTest, NamedFormatFields) {
  const KVCacheFormat v41 = *NamedFormat(FormatId::kV41);
  EXPECT_EQ(v41, (KVCacheFormat{Q::kE4M3, 512, 32, 0, true, S::kUE8M0, true}));
  EXPECT_EQ(*NamedFormat(FormatId::kV41Fp4),
            (KVCacheFormat{Q::kE2M1, 512, 16, 0, true, S::kE4M3, true}));
  EXPECT_EQ(*NamedFormat(FormatId::kFp4Index),
            (KVCacheFormat{Q::kE2M1, 128, 32, 0, false, S::kUE8M0, false}));
  EXPECT_EQ(*NamedFormat(FormatId::kFp8Fp32SfIndex),
            (KVCacheFormat{Q::kE4M3, 128, 128, 0, false, S::kFP32, false}));
  EXPECT_EQ(*NamedFormat(FormatId::kMxfp8Index),
            (KVCacheFormat{Q::kE4M3, 128, 32, 0, false, S::kUE8M0, false}));
  EXPECT_EQ(*NamedFormat(FormatId::kBf16, 6),
            (KVCacheFormat{Q::kNone, 0, 0, 6, true, S::kNone, false}));
  EXPECT_FALSE(NamedFormat(FormatId::kBf16).ok());      // needs N
  EXPECT_FALSE(NamedFormat(FormatId::kV41, 512).ok());  // takes no N
}

// Each rule of SPEC §2, broken alone, with words its message must contain.
struct Broken {
  KVCacheFormat format;
  std::vector<std::string> words;
};

TEST(FormatTest, EveryValidationRuleIsRejectedByName) {
  const std::vector<Broken> cases = {
      // No quantization: quantized_elements = elements_per_sf = 0.
      {{Q::kNone, 8, 0, 8, true, S::kNone, false},
       {"quantized_elements", "got 8"}},
      {{Q::kNone, 0, 4, 8, true, S::kNone, false},
       {"elements_per_sf", "got 0 and 4"}},
      // ... and no sf_format.
      {{Q::kNone, 0, 0, 8, true, S::kUE8M0, false}, {"sf_format"}},
      // BF16 element count even and >= 2.
      {{Q::kNone, 0, 0, 7, true, S::kNone, false}, {"bf16_elements = 7"}},
      {{Q::kNone, 0, 0, 0, true, S::kNone, false}, {"bf16_elements = 0"}},
      // Quantization: both counts > 0.
      {{Q::kE4M3, 0, 32, 0, true, S::kUE8M0, true},
       {"quantized_elements", "got 0 and 32"}},
      {{Q::kE4M3, 64, 0, 0, true, S::kUE8M0, true},
       {"elements_per_sf", "got 64 and 0"}},
      // elements_per_sf divides quantized_elements.
      {{Q::kE4M3, 100, 32, 0, true, S::kUE8M0, true},
       {"elements_per_sf = 32 does not divide quantized_elements = 100"}},
      // sf_format set.
      {{Q::kE4M3, 64, 32, 0, true, S::kNone, true}, {"sf_format"}},
      {{Q::kE4M3, 64, 32, 0, true, static_cast<S>(9), true}, {"sf_format"}},
      // A BF16 tail on a quantized format needs token_interleaved (SPEC
      // §2.1) and stays within the record bound.
      {{Q::kE4M3, 64, 32, 8, false, S::kUE8M0, false},
       {"BF16 tail", "bf16_elements = 8", "token_interleaved"}},
      {{Q::kE4M3, 64, 32, -2, true, S::kUE8M0, true}, {"bf16_elements = -2"}},
      // pow2_ceil scale rounding needs fp32 scales; unknown roundings fail.
      {{Q::kE4M3, 64, 32, 0, true, S::kUE8M0, true, ScaleRounding::kPow2Ceil},
       {"pow2_ceil needs sf_format fp32"}},
      {{Q::kE4M3, 64, 32, 0, true, S::kFP32, true,
        static_cast<ScaleRounding>(5)},
       {"scale_rounding = 5"}},
      // do_cast => token_interleaved.
      {{Q::kE4M3, 64, 32, 0, true, S::kUE8M0, false},
       {"do_cast", "token_interleaved"}},
      // e2m1 => even element counts.
      {{Q::kE2M1, 66, 33, 0, false, S::kUE8M0, false},
       {"e2m1", "even", "elements_per_sf = 33"}},
      // Unknown dtype.
      {{static_cast<Q>(7), 64, 32, 0, false, S::kUE8M0, false},
       {"quantized_dtype = 7"}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const absl::Status s = ValidateFormat(cases[i].format);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "case " << i;
    for (const std::string& w : cases[i].words) {
      EXPECT_THAT(std::string(s.message()), HasSubstr(w)) << "case " << i;
    }
    const KVCacheFormat& f = cases[i].format;
    EXPECT_FALSE(MakeFormat(f.quantized_dtype, f.quantized_elements,
                            f.elements_per_sf, f.bf16_elements, f.do_cast,
                            f.sf_format, f.token_interleaved, f.scale_rounding)
                     .ok())
        << "case " << i;
  }
  // BF16 is exempt from do_cast => token_interleaved: it has no scales.
  EXPECT_TRUE(ValidateFormat({Q::kNone, 0, 0, 8, true, S::kNone, false}).ok());
}

TEST(FormatTest, NamesRoundTrip) {
  for (const char* name : {"V41", "V41_FP4", "FP4_INDEX", "FP8_FP32SF_INDEX",
                           "MXFP8_INDEX", "BF16(2)", "BF16(512)", "BF16(6)"}) {
    absl::StatusOr<KVCacheFormat> f = FormatFromName(name);
    ASSERT_TRUE(f.ok()) << name;
    EXPECT_EQ(*FormatName(*f), name);
    EXPECT_EQ(*FormatFromName(*FormatName(*f)), *f);
  }
  for (FormatId id : kAllFormatIds) {
    const KVCacheFormat f = *NamedFormat(id, id == FormatId::kBf16 ? 64 : 0);
    EXPECT_EQ(IdentifyFormat(f), id);
    EXPECT_EQ(*FormatFromName(*FormatName(f)), f);
  }
  EXPECT_EQ(*FormatFromName("v41_fp4"), *NamedFormat(FormatId::kV41Fp4));
  EXPECT_EQ(*FormatFromName("bf16(8)"), *NamedFormat(FormatId::kBf16, 8));
  for (const char* bad :
       {"V42", "", "BF16()", "BF16(x)", "BF16(+4)", "BF16( 4)", "BF16(-4)",
        "BF16(3)", "BF16(4", "BF16(99999999999)"}) {
    absl::StatusOr<KVCacheFormat> f = FormatFromName(bad);
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_THAT(std::string(FormatFromName("V42").status().message()),
              AllOf(HasSubstr("\"V42\""), HasSubstr("BF16(N)")));
  // A valid custom format has no name.
  const KVCacheFormat custom{Q::kE4M3, 64, 32, 0, true, S::kUE8M0, true};
  EXPECT_FALSE(FormatName(custom).ok());
  EXPECT_FALSE(IdentifyFormat(custom).has_value());
}

TEST(FormatTest, ScaleAndDtypeNames) {
  for (S f : {S::kNone, S::kUE8M0, S::kE4M3, S::kFP32}) {
    EXPECT_EQ(*ScaleFormatFromName(ScaleFormatName(f)), f);
  }
  EXPECT_EQ(*ScaleFormatFromName("UE8M0"), S::kUE8M0);
  EXPECT_FALSE(ScaleFormatFromName("ue8m1").ok());
  EXPECT_EQ(QuantDtypeName(Q::kE2M1), "e2m1");
}

TEST(FormatTest, ResolveFormat) {
  EXPECT_EQ(*ResolveFormat(528), *NamedFormat(FormatId::kV41));
  EXPECT_EQ(*ResolveFormat(288), *NamedFormat(FormatId::kV41Fp4));
  EXPECT_EQ(*ResolveFormat(68), *NamedFormat(FormatId::kFp4Index));
  EXPECT_EQ(*ResolveFormat(1024), *NamedFormat(FormatId::kBf16, 512));
  // 132 is two formats: the error names both; a hint picks one.
  const absl::Status amb = ResolveFormat(132).status();
  EXPECT_EQ(amb.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(amb.message()),
              AllOf(HasSubstr("ambiguous"), HasSubstr("FP8_FP32SF_INDEX"),
                    HasSubstr("MXFP8_INDEX")));
  EXPECT_EQ(*ResolveFormat(132, S::kFP32),
            *NamedFormat(FormatId::kFp8Fp32SfIndex));
  EXPECT_EQ(*ResolveFormat(132, S::kUE8M0),
            *NamedFormat(FormatId::kMxfp8Index));
  // Hint `none` asks for BF16 even where a quantized format matches.
  EXPECT_EQ(*ResolveFormat(132, S::kNone), *NamedFormat(FormatId::kBf16, 66));
  EXPECT_EQ(*ResolveFormat(528, S::kNone), *NamedFormat(FormatId::kBf16, 264));
  // A quantized hint never yields BF16; unknown widths are NOT_FOUND.
  for (auto [width, hint] : std::vector<std::pair<int64_t, std::optional<S>>>{
           {130, std::nullopt},
           {0, std::nullopt},
           {-4, std::nullopt},
           {2, std::nullopt},
           {132, S::kE4M3},
           {1024, S::kUE8M0},
           {int64_t{1} << 40, std::nullopt}}) {
    const absl::Status s = ResolveFormat(width, hint).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << width;
    EXPECT_THAT(std::string(s.message()),
                HasSubstr(absl::StrCat("bytes_per_token = ", width)));
  }
}

}  // namespace
}  // namespace kvdepot
