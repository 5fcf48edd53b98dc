#include "server/step/step_histogram.h"

#include <cmath>
#include <limits>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvdepot::step {
namespace {

using ::testing::HasSubstr;

TEST(HistogramTest, ValuesLandInTheFirstBucketThatHoldsThem) {
  Histogram h;
  h.Add(kPhaseBoundsUs, 0);      // <= 5
  h.Add(kPhaseBoundsUs, 5);      // <= 5 (bounds are inclusive)
  h.Add(kPhaseBoundsUs, 5.001);  // <= 10
  h.Add(kPhaseBoundsUs, 1e9);    // +Inf
  h.Add(kPhaseBoundsUs, std::numeric_limits<double>::quiet_NaN());  // +Inf
  EXPECT_EQ(h.buckets[0], 2u);
  EXPECT_EQ(h.buckets[1], 1u);
  EXPECT_EQ(h.buckets[kHistogramBounds], 2u);
  EXPECT_EQ(h.Count(), 5u);
  EXPECT_DOUBLE_EQ(h.sum, 0 + 5 + 5.001 + 1e9);  // NaN left out
}

TEST(HistogramTest, QuantileInterpolatesInsideTheBucket) {
  Histogram h;
  EXPECT_EQ(h.Quantile(kPhaseBoundsUs, 0.5), 0);          // empty
  for (int i = 0; i < 4; ++i) h.Add(kPhaseBoundsUs, 15);  // (10, 20]
  // rank 2 of 4 in (10, 20]: halfway.
  EXPECT_DOUBLE_EQ(h.Quantile(kPhaseBoundsUs, 0.5), 15);
  EXPECT_DOUBLE_EQ(h.Quantile(kPhaseBoundsUs, 1.0), 20);
  h.Add(kPhaseBoundsUs, 3);  // (0, 5]
  // rank 0.5 of 5: inside the first bucket, from 0.
  EXPECT_DOUBLE_EQ(h.Quantile(kPhaseBoundsUs, 0.1), 2.5);
  Histogram inf;
  inf.Add(kPhaseBoundsUs, 1e9);
  EXPECT_DOUBLE_EQ(inf.Quantile(kPhaseBoundsUs, 0.5), kPhaseBoundsUs.back());
}

TEST(HistogramTest, MergeAddsCountsAndSums) {
  Histogram a, b;
  a.Add(kPhaseBoundsUs, 7);
  b.Add(kPhaseBoundsUs, 7);
  b.Add(kPhaseBoundsUs, 700);
  a.Merge(b);
  EXPECT_EQ(a.Count(), 3u);
  EXPECT_EQ(a.buckets[1], 2u);
  EXPECT_DOUBLE_EQ(a.sum, 714);
}

TEST(HistogramTest, RendersCumulativeBucketsSumAndCount) {
  Histogram h;
  h.Add(kStepLatencyBoundsUs, 70);
  h.Add(kStepLatencyBoundsUs, 1e6);
  std::string out;
  AppendHistogram(&out, "m", "r=\"1\"", kStepLatencyBoundsUs, h);
  EXPECT_THAT(out, HasSubstr("m_bucket{r=\"1\",le=\"50\"} 0\n"));
  EXPECT_THAT(out, HasSubstr("m_bucket{r=\"1\",le=\"100\"} 1\n"));
  EXPECT_THAT(out, HasSubstr("m_bucket{r=\"1\",le=\"100000\"} 1\n"));
  EXPECT_THAT(out, HasSubstr("m_bucket{r=\"1\",le=\"+Inf\"} 2\n"));
  EXPECT_THAT(out, HasSubstr("m_sum{r=\"1\"} 1000070\n"));
  EXPECT_THAT(out, HasSubstr("m_count{r=\"1\"} 2\n"));
  std::string bare;
  AppendHistogram(&bare, "m", "", kStepLatencyBoundsUs, h);
  EXPECT_THAT(bare, HasSubstr("m_bucket{le=\"+Inf\"} 2\n"));
  EXPECT_THAT(bare, HasSubstr("m_count 2\n"));
}

}  // namespace
}  // namespace kvdepot::step
