#include "client/kvcachectl/output.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvdepot::ctl {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

// Counters whose proto name would clash with a list elsewhere.
std::string JsonName(const FieldDescriptor* f) {
  const std::string& m = f->containing_type()->name();
  if ((m == "StatsResponse" || m == "DrainResponse") &&
      (f->name() == "pools" || f->name() == "sessions" ||
       f->name() == "buffers")) {
    return "num_" + f->name();
  }
  return f->name();
}

Json Float(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  return v;
}

std::string BytesHex(const std::string& b) {
  std::string out;
  for (unsigned char c : b) absl::StrAppendFormat(&out, "%02x", c);
  return out;
}

// One value of field `f` (element `i` when repeated, else i = -1).
Json Value(const Message& m, const FieldDescriptor* f, int i) {
  const Reflection* r = m.GetReflection();
  const bool rep = i >= 0;
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return rep ? r->GetRepeatedInt32(m, f, i) : r->GetInt32(m, f);
    case FieldDescriptor::CPPTYPE_INT64:
      return rep ? r->GetRepeatedInt64(m, f, i) : r->GetInt64(m, f);
    case FieldDescriptor::CPPTYPE_UINT32:
      return rep ? r->GetRepeatedUInt32(m, f, i) : r->GetUInt32(m, f);
    case FieldDescriptor::CPPTYPE_UINT64: {
      const uint64_t v =
          rep ? r->GetRepeatedUInt64(m, f, i) : r->GetUInt64(m, f);
      if (f->type() == FieldDescriptor::TYPE_FIXED64) return HashHex(v);
      return v;
    }
    case FieldDescriptor::CPPTYPE_FLOAT:
      return Float(rep ? r->GetRepeatedFloat(m, f, i) : r->GetFloat(m, f));
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return Float(rep ? r->GetRepeatedDouble(m, f, i) : r->GetDouble(m, f));
    case FieldDescriptor::CPPTYPE_BOOL:
      return rep ? r->GetRepeatedBool(m, f, i) : r->GetBool(m, f);
    case FieldDescriptor::CPPTYPE_ENUM:
      return (rep ? r->GetRepeatedEnum(m, f, i) : r->GetEnum(m, f))->name();
    case FieldDescriptor::CPPTYPE_STRING: {
      const std::string s =
          rep ? r->GetRepeatedString(m, f, i) : r->GetString(m, f);
      return f->type() == FieldDescriptor::TYPE_BYTES ? BytesHex(s) : s;
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return ProtoToJson(rep ? r->GetRepeatedMessage(m, f, i)
                             : r->GetMessage(m, f));
  }
  return nullptr;
}

bool NeedsQuotes(const std::string& s) {
  if (s.empty()) return true;
  static const char* kWords[] = {"true", "false",    "null",     "yes",
                                 "no",   "on",       "off",      "~",
                                 "NaN",  "Infinity", "-Infinity"};
  for (const char* w : kWords) {
    if (s == w) return true;
  }
  if (s.find_first_of(":#{}[],&*!|>'\"%@`\n\t\\") != std::string::npos ||
      s.front() == ' ' || s.back() == ' ' || s.front() == '-' ||
      s.front() == '?') {
    return true;
  }
  // Anything that reads as a number (hex hashes like "1234" or "1e10").
  return s.find_first_not_of("0123456789abcdefABCDEF.+-xXoO_") ==
         std::string::npos;
}

std::string Scalar(const Json& j) {
  if (j.is_string()) {
    const std::string& s = j.get_ref<const std::string&>();
    return NeedsQuotes(s) ? j.dump() : s;
  }
  return j.dump();
}

void Yaml(const Json& j, int indent, std::string* out) {
  const std::string pad(indent, ' ');
  if (j.is_object()) {
    for (const auto& [k, v] : j.items()) {
      absl::StrAppend(out, pad, k, ":");
      if ((v.is_object() || v.is_array()) && !v.empty()) {
        absl::StrAppend(out, "\n");
        Yaml(v, indent + 2, out);
      } else {
        absl::StrAppend(out, " ",
                        v.is_object()  ? "{}"
                        : v.is_array() ? "[]"
                                       : Scalar(v),
                        "\n");
      }
    }
  } else if (j.is_array()) {
    for (const auto& v : j) {
      if ((v.is_object() || v.is_array()) && !v.empty()) {
        // "- " then the first line of the nested block on the same line.
        std::string inner;
        Yaml(v, indent + 2, &inner);
        absl::StrAppend(out, pad, "- ", inner.substr(indent + 2));
      } else {
        absl::StrAppend(out, pad, "- ",
                        v.is_object()  ? "{}"
                        : v.is_array() ? "[]"
                                       : Scalar(v),
                        "\n");
      }
    }
  } else {
    absl::StrAppend(out, pad, Scalar(j), "\n");
  }
}

}  // namespace

std::string HashHex(uint64_t v) { return absl::StrFormat("%016x", v); }

Json ProtoToJson(const Message& m) {
  Json out = Json::object();
  const auto* d = m.GetDescriptor();
  const Reflection* r = m.GetReflection();
  for (int k = 0; k < d->field_count(); ++k) {
    const FieldDescriptor* f = d->field(k);
    // A oneof prints only its set member.
    if (f->containing_oneof() != nullptr && !r->HasField(m, f)) continue;
    if (f->is_repeated()) {
      Json a = Json::array();
      for (int i = 0; i < r->FieldSize(m, f); ++i) a.push_back(Value(m, f, i));
      out[JsonName(f)] = std::move(a);
    } else {
      out[JsonName(f)] = Value(m, f, -1);
    }
  }
  return out;
}

void PrintStructured(const Json& j, OutputFormat format, std::ostream& out) {
  if (format == OutputFormat::kYaml) {
    out << ToYaml(j);
  } else {
    out << j.dump(-1, ' ', false, Json::error_handler_t::replace) << "\n";
  }
}

std::string ToYaml(const Json& j) {
  std::string out = "---\n";
  Yaml(j, 0, &out);
  return out;
}

}  // namespace kvdepot::ctl
