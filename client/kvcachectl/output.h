// kvcachectl's machine-readable output: protos and hand-built results as
// Json, printed as one line of JSON or as YAML.
//
// The rules (the schema is docs/OPERATING.md "JSON output"; the ops test
// checks every command's output against it):
//   - sizes, counts, ids and offsets are JSON numbers (never strings);
//   - 64-bit hashes (fixed64 fields, e.g. xxh3) are 16-digit hex strings;
//   - bytes are lower-case hex strings; enums their names;
//   - floats are numbers, NaN and infinities the strings "NaN",
//     "Infinity", "-Infinity" (as in the proto3 JSON mapping);
//   - every field is printed, also when it holds its default;
//   - a name means one thing in every command: the daemon's counters of
//     pools, sessions and buffers are num_pools, num_sessions and
//     num_buffers, because "pools" is the list of pools.
#ifndef KVDEPOT_CLIENT_KVCACHECTL_OUTPUT_H_
#define KVDEPOT_CLIENT_KVCACHECTL_OUTPUT_H_

#include <google/protobuf/message.h>

#include <cstdint>
#include <ostream>
#include <string>

#include "nlohmann/json.hpp"

namespace kvdepot::ctl {

// Keeps fields in the order they were added (proto field order).
using Json = nlohmann::ordered_json;

enum class OutputFormat { kTable, kJson, kYaml };

// `m` under the rules above (field names as in kvdepot.proto).
Json ProtoToJson(const google::protobuf::Message& m);

// A 64-bit hash as 16 lower-case hex digits.
std::string HashHex(uint64_t v);

// Prints `j` as one line of JSON or as a YAML document (kJson / kYaml).
void PrintStructured(const Json& j, OutputFormat format, std::ostream& out);

// `j` as YAML (block style; strings quoted where YAML would misread them).
std::string ToYaml(const Json& j);

}  // namespace kvdepot::ctl

#endif  // KVDEPOT_CLIENT_KVCACHECTL_OUTPUT_H_
