// Prometheus-style histograms of the step path's metrics (step time, phase
// time): counts per bucket of fixed upper bounds, +Inf last, and the sum.
#ifndef KVDEPOT_SERVER_STEP_STEP_HISTOGRAM_H_
#define KVDEPOT_SERVER_STEP_STEP_HISTOGRAM_H_

#include <array>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace kvdepot::step {

inline constexpr int kHistogramBounds = 11;
using HistogramBounds = std::array<double, kHistogramBounds>;

// Upper bounds (us) of the host-seen step time's buckets.
inline constexpr HistogramBounds kStepLatencyBoundsUs = {
    50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000};
// Upper bounds (us) of the GPU phase time's buckets (a phase's kernels run
// for microseconds in decode, milliseconds in a long prefill).
inline constexpr HistogramBounds kPhaseBoundsUs = {
    5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 20000};

struct Histogram {
  std::array<uint64_t, kHistogramBounds + 1> buckets = {};  // +Inf last
  double sum = 0;

  // Counts `value` (NaN counts in +Inf and not in the sum).
  void Add(const HistogramBounds& bounds, double value);
  void Merge(const Histogram& other);
  uint64_t Count() const;
  // The q-quantile (0 <= q <= 1) as Prometheus' histogram_quantile
  // estimates it: linear inside the bucket holding it, from 0 in the
  // first; the last finite bound when it falls in +Inf; 0 when empty.
  double Quantile(const HistogramBounds& bounds, double q) const;
};

// Appends the _bucket, _sum and _count lines of `h` to `out`; `labels`
// are the series' labels without braces (may be empty).
void AppendHistogram(std::string* out, absl::string_view name,
                     absl::string_view labels, const HistogramBounds& bounds,
                     const Histogram& h);

}  // namespace kvdepot::step

#endif  // KVDEPOT_SERVER_STEP_STEP_HISTOGRAM_H_
