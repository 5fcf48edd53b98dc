// The callback serving model's choice between running a data-path call on
// the gRPC thread that read it and handing it to a worker pool
// (server/serving.h). Only sizes and flags of the request are read; the
// handler validates them.
#ifndef KVDEPOT_SERVER_SERVING_POLICY_H_
#define KVDEPOT_SERVER_SERVING_POLICY_H_

#include <algorithm>
#include <cstdint>

#include "absl/strings/string_view.h"
#include "kvdepot/v1/kvdepot.pb.h"

namespace kvdepot {

// a * b <= limit for untrusted a, b (negative values are small: the
// handler rejects them at once).
inline bool ProductAtMost(int64_t a, int64_t b, int64_t limit) {
  if (a <= 0 || b <= 0) return true;
  return a <= limit / b;
}

// Which data-path calls leave the gRPC thread for a worker pool
// (serving.h): on a device backend every call that may wait for the GPU;
// on the CPU backend every call whose work is more than a few thousand
// rows or entries, counting every array the handler reads whole. `device`
// = the backend's calls may wait for the GPU.
struct OffloadPolicy {
  int64_t rows;  // inline_max_rows
  bool device;   // backend_waits_for_device()

  // A Store/Load that can return without waiting for the GPU: ordered by a
  // recorded event, no client event to await, no inline (host) data.
  bool DeviceAsync(const v1::DataRef& a, const v1::DataRef* b,
                   absl::string_view wait, bool record) const {
    auto host = [](const v1::DataRef& d) {
      return d.kind_case() == v1::DataRef::kInlineData ||
             d.kind_case() == v1::DataRef::kInlineOutput;
    };
    return record && wait.empty() && !host(a) && (b == nullptr || !host(*b));
  }
  bool Offload(const v1::StoreRequest& r) const {
    if (device) {
      return !DeviceAsync(r.kv(), nullptr, r.wait_event_ipc_handle(),
                          r.record_event());
    }
    return r.num_tokens() > rows;
  }
  bool Offload(const v1::LoadRequest& r) const {
    if (device) {
      return !DeviceAsync(r.data(), &r.scales(), r.wait_event_ipc_handle(),
                          r.record_event());
    }
    if (r.has_segments()) return r.segments().total_k() > rows;
    // A block holds up to 64 tokens or more.
    return Entries(r.sequences()) > rows / 16;
  }
  bool Offload(const v1::BuildPlanRequest& r) const {
    return Entries(r.sequences()) > rows * 4;
  }
  // The index calls: on a device, only those answered before the GPU
  // finishes (record_event, output in a buffer, no event to await) stay.
  bool Offload(const v1::ConvertTopkRequest& r) const {
    if (device) {
      return !(r.record_event() && r.wait_event_ipc_handle().empty() &&
               r.has_slots_buffer());
    }
    // Every array is read whole (one in a buffer is copied first).
    const int64_t n = rows * 16;
    return r.batch() > n || !ProductAtMost(r.batch(), r.k(), n) ||
           !ProductAtMost(r.batch(), r.max_blocks_per_seq(), n);
  }
  bool Offload(const v1::SwaDecodeIndexRequest& r) const {
    if (device) {
      return !(r.record_event() && r.wait_event_ipc_handle().empty() &&
               r.has_slots_buffer());
    }
    const int64_t n = rows * 16;
    return r.num_queries() > n / 3 ||
           !ProductAtMost(r.num_queries(), r.window(), n);
  }

 private:
  // The larger of a sequence plan's two inline arrays, in entries (4
  // bytes each).
  static int64_t Entries(const v1::SequencePlan& p) {
    return static_cast<int64_t>(
               std::max(p.block_table().size(), p.seqlen_k().size())) /
           4;
  }
};

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_SERVING_POLICY_H_
