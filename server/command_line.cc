#include "server/command_line.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "server/logging.h"
#include "server/version.h"

namespace kvdepot {
namespace {

bool IsAbslUsageFlag(absl::string_view name) {
  return name == "helpfull" || name == "helpshort" || name == "helppackage" ||
         name == "helpmatch" || name == "only_check_args" ||
         absl::StartsWith(name, "helpon");
}

std::string TypeName(const absl::CommandLineFlag& f) {
  if (f.IsOfType<bool>()) return "bool";
  if (f.IsOfType<int64_t>() || f.IsOfType<int32_t>()) return "int";
  if (f.IsOfType<double>()) return "float";
  return "string";
}

}  // namespace

int HandleHelpAndVersion(int argc, char** argv, absl::string_view about,
                         absl::string_view flags_file, std::ostream& out) {
  for (int i = 1; i < argc; ++i) {
    const absl::string_view a = argv[i];
    if (a == "--") break;
    if (a == "--version" || a == "-version") {
      out << "kvdepotd " << kKvdepotVersion << "\n";
      return 0;
    }
    if (a != "-h" && a != "--help" && a != "-help") continue;
    out << about << "\n\nUsage: " << absl::ProgramUsageMessage()
        << "\n\nFlags:\n";
    std::vector<const absl::CommandLineFlag*> flags;
    for (const auto& [name, flag] : absl::GetAllFlags()) {
      if (absl::EndsWith(flag->Filename(), flags_file)) flags.push_back(flag);
    }
    std::sort(flags.begin(), flags.end(),
              [](auto* a, auto* b) { return a->Name() < b->Name(); });
    for (const absl::CommandLineFlag* f : flags) {
      out << absl::StrFormat("  --%s (%s, default \"%s\")\n      %s\n",
                             f->Name(), TypeName(*f), f->DefaultValue(),
                             f->Help());
    }
    out << "  -h, --help\n      this text\n  --version\n      the version\n"
        << "  --helpfull\n      also the flags of the libraries\n";
    return 0;
  }
  return -1;
}

absl::Status CheckFlagSyntax(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const absl::string_view a = argv[i];
    if (a == "--") {
      if (i + 1 < argc) {
        return absl::InvalidArgumentError(
            absl::StrCat("unexpected argument \"", EscapeForLog(argv[i + 1]),
                         "\" (kvdepotd takes only flags)"));
      }
      break;
    }
    absl::string_view body = a;
    if (!absl::ConsumePrefix(&body, "--") && !absl::ConsumePrefix(&body, "-")) {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected argument \"", EscapeForLog(a),
                       "\" (kvdepotd takes only flags)"));
    }
    const size_t eq = body.find('=');
    const absl::string_view name = body.substr(0, eq);
    if (IsAbslUsageFlag(name)) continue;
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    std::string value;
    if (flag == nullptr && absl::StartsWith(name, "no") &&
        eq == absl::string_view::npos) {
      flag = absl::FindCommandLineFlag(name.substr(2));
      if (flag != nullptr && !flag->IsOfType<bool>()) flag = nullptr;
      value = "false";
    } else if (flag != nullptr && eq != absl::string_view::npos) {
      value = std::string(body.substr(eq + 1));
    } else if (flag != nullptr && flag->IsOfType<bool>()) {
      value = "true";
    } else if (flag != nullptr) {
      if (i + 1 >= argc) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, " needs a value"));
      }
      value = argv[++i];
    }
    if (flag == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag \"", EscapeForLog(a), "\""));
    }
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag->Name(), " = \"", EscapeForLog(value),
                       "\" is not a valid ", TypeName(*flag), ": ", error));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckAddressFlag(absl::string_view flag, absl::string_view value,
                              bool unix_allowed) {
  if (unix_allowed && (value.empty() || absl::StartsWith(value, "/") ||
                       absl::StartsWith(value, "unix:"))) {
    return absl::OkStatus();
  }
  const std::string shown = EscapeForLog(value);
  const size_t colon = value.rfind(':');
  if (colon == absl::string_view::npos || colon == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, " = \"", shown, "\" is not host:port",
                     unix_allowed ? ", /path or unix:/path" : ""));
  }
  const absl::string_view port_text = value.substr(colon + 1);
  int64_t port = -1;
  if (port_text.empty() ||
      port_text.find_first_not_of("0123456789") != absl::string_view::npos ||
      !absl::SimpleAtoi(port_text, &port) || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", flag, " = \"", shown, "\": port \"", EscapeForLog(port_text),
        "\" is outside [1, 65535] (0 picks a free port)"));
  }
  return absl::OkStatus();
}

}  // namespace kvdepot
