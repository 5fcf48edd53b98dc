#include "server/data_refs.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/reply_scope.h"

namespace kvdepot {

absl::StatusOr<ByteRange> ResolveSlice(const SessionManager& sessions,
                                       const Caller& caller,
                                       absl::string_view field,
                                       const v1::BufferSlice& slice,
                                       int64_t expected) {
  absl::StatusOr<std::shared_ptr<Buffer>> buffer = sessions.GetBuffer(
      caller, absl::StrCat(field, ".buffer_id"), slice.buffer_id());
  if (!buffer.ok()) return buffer.status();
  const int64_t size = (*buffer)->memory->size();
  if (slice.length() != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".length = ", slice.length(),
                     ", the request needs exactly ", expected, " bytes"));
  }
  if (slice.offset() < 0 || slice.offset() > size ||
      slice.length() > size - slice.offset()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " [offset ", slice.offset(), ", +", slice.length(),
        ") is outside buffer ", slice.buffer_id(), " of ", size, " bytes"));
  }
  ByteRange r;
  r.data = (*buffer)->memory->data() + slice.offset();
  r.size = expected;
  r.offset = slice.offset();
  r.buffer = *std::move(buffer);
  return r;
}

absl::StatusOr<ByteRange> ResolveInput(const SessionManager& sessions,
                                       const Caller& caller,
                                       absl::string_view field,
                                       const v1::DataRef& ref,
                                       int64_t expected) {
  switch (ref.kind_case()) {
    case v1::DataRef::kSlice:
      return ResolveSlice(sessions, caller, absl::StrCat(field, ".slice"),
                          ref.slice(), expected);
    case v1::DataRef::kInlineData: {
      const std::string& bytes = ref.inline_data();
      if (static_cast<int64_t>(bytes.size()) != expected) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ".inline_data holds ", bytes.size(),
                         " bytes, the request needs exactly ", expected));
      }
      ByteRange r;
      // Inputs are only read; the cast lets one type serve both directions.
      r.data = reinterpret_cast<uint8_t*>(const_cast<char*>(bytes.data()));
      r.size = expected;
      return r;
    }
    default:
      if (expected == 0) return ByteRange{};
      return absl::InvalidArgumentError(
          absl::StrCat(field, " must be a buffer slice or inline_data (",
                       expected, " bytes)"));
  }
}

absl::StatusOr<ByteRange> ResolveOutput(const SessionManager& sessions,
                                        const Caller& caller,
                                        absl::string_view field,
                                        const v1::DataRef& ref,
                                        int64_t expected, int64_t max_inline,
                                        std::string* inline_out) {
  switch (ref.kind_case()) {
    case v1::DataRef::kSlice:
      return ResolveSlice(sessions, caller, absl::StrCat(field, ".slice"),
                          ref.slice(), expected);
    case v1::DataRef::kInlineOutput: {
      if (expected > max_inline) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ".inline_output: ", expected,
                         " bytes exceed the inline limit of ", max_inline,
                         "; use a buffer slice"));
      }
      RETURN_IF_ERROR(
          ReplyScope::Reserve(BudgetClientOf(caller), expected,
                              absl::StrCat(field, ".inline_output")));
      inline_out->assign(static_cast<size_t>(expected), '\0');
      ByteRange r;
      r.data = reinterpret_cast<uint8_t*>(inline_out->data());
      r.size = expected;
      return r;
    }
    default:
      if (expected == 0) return ByteRange{};
      return absl::InvalidArgumentError(
          absl::StrCat(field, " must be a buffer slice or inline_output (",
                       expected, " bytes)"));
  }
}

absl::Status CheckDisjoint(absl::string_view field_a, const ByteRange& a,
                           absl::string_view field_b, const ByteRange& b) {
  if (a.buffer == nullptr || a.buffer != b.buffer || a.size == 0 ||
      b.size == 0) {
    return absl::OkStatus();
  }
  if (a.offset < b.offset + b.size && b.offset < a.offset + a.size) {
    return absl::InvalidArgumentError(
        absl::StrCat(field_a, " [", a.offset, ", ", a.offset + a.size,
                     ") overlaps ", field_b, " [", b.offset, ", ",
                     b.offset + b.size, ") in buffer ", a.buffer->id));
  }
  return absl::OkStatus();
}

}  // namespace kvdepot
