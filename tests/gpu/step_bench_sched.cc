#include "tests/gpu/step_bench_sched.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace kvdepot::testing {

absl::StatusOr<std::unique_ptr<SchedulerProcess>> SchedulerProcess::Start(
    const std::vector<std::string>& argv) {
  if (argv.empty()) return absl::InvalidArgumentError("no scheduler program");
  int in[2], out[2];
  if (pipe2(in, O_CLOEXEC) != 0) return absl::InternalError("pipe2");
  if (pipe2(out, O_CLOEXEC) != 0) {
    close(in[0]);
    close(in[1]);
    return absl::InternalError("pipe2");
  }
  std::vector<char*> args;
  for (const std::string& a : argv)
    args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork");
  if (pid == 0) {
    dup2(in[0], 0);
    dup2(out[1], 1);
    execvp(args[0], args.data());
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  std::unique_ptr<SchedulerProcess> p(new SchedulerProcess());
  p->pid_ = pid;
  p->to_ = fdopen(in[1], "w");
  p->from_ = fdopen(out[0], "r");
  return p;
}

SchedulerProcess::~SchedulerProcess() {
  if (to_ != nullptr) fclose(to_);
  if (from_ != nullptr) fclose(from_);
  if (pid_ > 0) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, &status, 0);
    }
  }
}

absl::StatusOr<std::string> SchedulerProcess::Line() {
  char buf[4096];
  if (fgets(buf, sizeof(buf), from_) == nullptr) {
    return absl::InternalError("the scheduler process ended (see its stderr)");
  }
  return std::string(absl::StripTrailingAsciiWhitespace(buf));
}

absl::Status SchedulerProcess::Send(uint64_t step_id) {
  std::fprintf(to_, "%llu\n", static_cast<unsigned long long>(step_id));
  std::fflush(to_);
  absl::StatusOr<std::string> line = Line();
  if (!line.ok()) return line.status();
  if (absl::StartsWith(*line, "ok")) return absl::OkStatus();
  std::vector<std::string> parts =
      absl::StrSplit(*line, absl::MaxSplits(' ', 2));
  int code = 0;
  if (parts.size() == 3 && parts[0] == "err" &&
      absl::SimpleAtoi(parts[1], &code) && code > 0 && code < 17) {
    return absl::Status(static_cast<absl::StatusCode>(code), parts[2]);
  }
  return absl::InternalError(absl::StrCat("scheduler said: ", *line));
}

absl::StatusOr<double> SchedulerProcess::Finish() {
  std::fprintf(to_, "q\n");
  std::fflush(to_);
  absl::StatusOr<std::string> line = Line();
  if (!line.ok()) return line.status();
  // "cpu_us <x> steps <n>" and then " retries <r>"
  std::vector<std::string> parts = absl::StrSplit(*line, ' ');
  double cpu = 0;
  int steps = 0;
  if ((parts.size() != 4 && parts.size() != 6) || parts[0] != "cpu_us" ||
      !absl::SimpleAtod(parts[1], &cpu) ||
      !absl::SimpleAtoi(parts[3], &steps) ||
      (parts.size() == 6 &&
       (parts[4] != "retries" || !absl::SimpleAtoi(parts[5], &retries_)))) {
    return absl::InternalError(absl::StrCat("scheduler said: ", *line));
  }
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
  return steps > 0 ? cpu / steps : 0.0;
}

std::string BesideSelf(const std::string& name) {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return name;
  const std::string path(self, static_cast<size_t>(n));
  const std::string dir = path.substr(0, path.rfind('/') + 1);
  if (access((dir + name).c_str(), F_OK) == 0) return dir + name;
  return name;
}

}  // namespace kvdepot::testing
