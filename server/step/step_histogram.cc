#include "server/step/step_histogram.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvdepot::step {

void Histogram::Add(const HistogramBounds& bounds, double value) {
  size_t b = 0;
  if (std::isnan(value)) {
    b = bounds.size();
  } else {
    while (b < bounds.size() && value > bounds[b]) ++b;
    sum += value;
  }
  ++buckets[b];
}

void Histogram::Merge(const Histogram& other) {
  for (size_t b = 0; b < buckets.size(); ++b) buckets[b] += other.buckets[b];
  sum += other.sum;
}

uint64_t Histogram::Count() const {
  uint64_t n = 0;
  for (uint64_t c : buckets) n += c;
  return n;
}

double Histogram::Quantile(const HistogramBounds& bounds, double q) const {
  const uint64_t n = Count();
  if (n == 0) return 0;
  q = q < 0 ? 0 : (q > 1 ? 1 : q);
  const double rank = q * static_cast<double>(n);
  uint64_t below = 0;
  for (size_t b = 0; b < bounds.size(); ++b) {
    if (buckets[b] > 0 && static_cast<double>(below + buckets[b]) >= rank) {
      const double lo = b == 0 ? 0 : bounds[b - 1];
      const double in =
          (rank - static_cast<double>(below)) / static_cast<double>(buckets[b]);
      return lo + (bounds[b] - lo) * in;
    }
    below += buckets[b];
  }
  return bounds.back();
}

void AppendHistogram(std::string* out, absl::string_view name,
                     absl::string_view labels, const HistogramBounds& bounds,
                     const Histogram& h) {
  const absl::string_view sep = labels.empty() ? "" : ",";
  uint64_t cumulative = 0;
  for (size_t b = 0; b < h.buckets.size(); ++b) {
    cumulative += h.buckets[b];
    const std::string le =
        b < bounds.size() ? absl::StrCat(bounds[b]) : std::string("+Inf");
    absl::StrAppend(out, name, "_bucket{", labels, sep, "le=\"", le, "\"} ",
                    cumulative, "\n");
  }
  const std::string braces =
      labels.empty() ? std::string() : absl::StrCat("{", labels, "}");
  absl::StrAppend(out, name, "_sum", braces, " ",
                  absl::StrFormat("%.17g", h.sum), "\n", name, "_count", braces,
                  " ", cumulative, "\n");
}

}  // namespace kvdepot::step
