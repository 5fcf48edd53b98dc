#include "client/kvcachectl/args.h"

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvdepot::ctl {
namespace {

const FlagSpec* FindFlag(const CommandSpec& spec, absl::string_view name) {
  for (const FlagSpec& f : spec.flags) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

}  // namespace

bool ParsedArgs::Has(absl::string_view name) const {
  return values_.find(name) != values_.end();
}

std::string ParsedArgs::Get(absl::string_view name) const {
  auto it = values_.find(name);
  if (it != values_.end()) return it->second;
  const FlagSpec* f = spec_ == nullptr ? nullptr : FindFlag(*spec_, name);
  return f == nullptr ? std::string() : f->default_value;
}

absl::StatusOr<int64_t> ParsedArgs::GetInt(absl::string_view name, int64_t min,
                                           int64_t max) const {
  const std::string text = Get(name);
  int64_t v = 0;
  if (!absl::SimpleAtoi(text, &v)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, " = \"", text, "\" is not an integer"));
  }
  if (v < min || v > max) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--%s = %d is outside [%d, %d]", std::string(name), v, min, max));
  }
  return v;
}

absl::StatusOr<ParsedArgs> ParseArgs(const CommandSpec& spec,
                                     const std::vector<std::string>& args) {
  ParsedArgs out;
  out.spec_ = &spec;
  bool only_positional = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (only_positional || a.size() < 2 || a[0] != '-') {
      out.positional_.push_back(a);
      continue;
    }
    if (a == "--") {
      only_positional = true;
      continue;
    }
    if (a == "--help" || a == "-h") {
      out.help_ = true;
      continue;
    }
    std::string name;
    std::string value;
    bool has_value = false;
    if (a == "-o") {
      name = "output";
    } else if (a.rfind("--", 0) == 0) {
      const size_t eq = a.find('=');
      name = a.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
      if (eq != std::string::npos) {
        value = a.substr(eq + 1);
        has_value = true;
      }
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag \"", a, "\""));
    }
    const FlagSpec* f = FindFlag(spec, name);
    if (f == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag \"--", name,
                       "\" (see --help for the flags of this "
                       "command)"));
    }
    if (f->is_bool) {
      if (!has_value) value = "true";
      if (value != "true" && value != "false") {
        return absl::InvalidArgumentError(absl::StrCat(
            "--", name, " takes true or false, got \"", value, "\""));
      }
    } else if (!has_value) {
      if (i + 1 >= args.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("flag --", name, " needs a value"));
      }
      value = args[++i];
    }
    out.values_[name] = value;
  }
  return out;
}

std::string HelpText(const CommandSpec& spec) {
  std::string out =
      absl::StrCat("Usage: ", spec.usage, "\n\n", spec.description, "\n");
  if (!spec.flags.empty()) absl::StrAppend(&out, "\nFlags:\n");
  for (const FlagSpec& f : spec.flags) {
    std::string left = f.name == "output" ? "-o, --output" : "--" + f.name;
    if (!f.is_bool) absl::StrAppend(&left, " VALUE");
    absl::StrAppendFormat(&out, "  %-24s %s", left, f.help);
    if (!f.default_value.empty()) {
      absl::StrAppend(&out, " (default ", f.default_value, ")");
    }
    absl::StrAppend(&out, "\n");
  }
  absl::StrAppend(&out, "  -h, --help               show this help\n");
  return out;
}

std::vector<std::string> HoistGlobalFlags(std::vector<std::string> args) {
  std::vector<std::string> globals;
  size_t i = 0;
  while (i < args.size()) {
    const std::string& a = args[i];
    const bool with_value =
        a == "--addr" || a == "--timeout" || a == "-o" || a == "--output";
    const bool inline_value = a.rfind("--addr=", 0) == 0 ||
                              a.rfind("--timeout=", 0) == 0 ||
                              a.rfind("--output=", 0) == 0;
    if (with_value && i + 1 < args.size()) {
      globals.insert(globals.end(), {a, args[i + 1]});
      i += 2;
    } else if (inline_value) {
      globals.push_back(a);
      ++i;
    } else {
      break;
    }
  }
  std::vector<std::string> out(args.begin() + i, args.end());
  out.insert(out.end(), globals.begin(), globals.end());
  return out;
}

}  // namespace kvdepot::ctl
