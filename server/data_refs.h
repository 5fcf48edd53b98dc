// Resolution of the DataRef fields of a request (kvdepot.proto): a slice of
// a shared buffer, inline request bytes, or inline reply bytes. Every range
// is checked against its buffer and against the size the request needs
// before anything is read or written. A buffer slice needs the caller to
// own the buffer or be granted it.
#ifndef KVDEPOT_SERVER_DATA_REFS_H_
#define KVDEPOT_SERVER_DATA_REFS_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvdepot/v1/kvdepot.pb.h"
#include "server/sessions.h"

namespace kvdepot {

// A resolved byte range; `buffer` keeps a shared buffer alive while used.
struct ByteRange {
  uint8_t* data = nullptr;
  int64_t size = 0;
  std::shared_ptr<Buffer> buffer;  // null for inline bytes
  int64_t offset = 0;              // inside `buffer`
};

// A buffer slice of exactly `expected` bytes (input or output); `field`
// names the slice in errors ("topk_buffer": "topk_buffer.length = ...").
absl::StatusOr<ByteRange> ResolveSlice(const SessionManager& sessions,
                                       const Caller& caller,
                                       absl::string_view field,
                                       const v1::BufferSlice& slice,
                                       int64_t expected);

// An input of exactly `expected` bytes: inline_data or a buffer slice.
absl::StatusOr<ByteRange> ResolveInput(const SessionManager& sessions,
                                       const Caller& caller,
                                       absl::string_view field,
                                       const v1::DataRef& ref,
                                       int64_t expected);

// An output of exactly `expected` bytes: a buffer slice, or with
// inline_output the reply string `inline_out` (resized, zero-filled;
// at most max_inline bytes).
absl::StatusOr<ByteRange> ResolveOutput(const SessionManager& sessions,
                                        const Caller& caller,
                                        absl::string_view field,
                                        const v1::DataRef& ref,
                                        int64_t expected, int64_t max_inline,
                                        std::string* inline_out);

// INVALID_ARGUMENT when two ranges of the same buffer overlap.
absl::Status CheckDisjoint(absl::string_view field_a, const ByteRange& a,
                           absl::string_view field_b, const ByteRange& b);

}  // namespace kvdepot

#endif  // KVDEPOT_SERVER_DATA_REFS_H_
