#include "server/step/step_registry.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "proto/step_doorbell.h"
#include "server/log_limiter.h"
#include "server/step/plan_export.h"
#include "spdlog/spdlog.h"

namespace kvdepot::step {
namespace {

// A registration's name (untrusted, <= 64 bytes) as a Prometheus label
// value: backslash, quote and newline escaped, other control and non-ASCII
// bytes shown as '?', so a name can neither end the label nor the line.
std::string PrometheusLabel(absl::string_view name) {
  std::string out;
  for (const char c : name) {
    if (c == '\\' || c == '"') {
      out.push_back('\\');
      out.push_back(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (static_cast<unsigned char>(c) < 0x20 ||
               static_cast<unsigned char>(c) >= 0x7f) {
      out.push_back('?');
    } else {
      out.push_back(c);
    }
  }
  return out;
}

}  // namespace

StepRegistry::StepRegistry(StepEngineFactory* factory,
                           const PoolRegistry* pools,
                           const SessionManager* sessions,
                           RegistryOptions options)
    : factory_(factory), pools_(pools), sessions_(sessions), options_(options) {
  if (options_.watch_interval > absl::ZeroDuration()) {
    watcher_ = std::thread([this] { WatchLoop(); });
  }
}

StepRegistry::~StepRegistry() {
  std::vector<std::shared_ptr<Registration>> all;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (auto& [id, reg] : regs_) all.push_back(reg);
    regs_.clear();
    for (auto& reg : retired_) all.push_back(reg);
    retired_.clear();
  }
  if (watcher_.joinable()) watcher_.join();
  for (auto& reg : all) {
    absl::MutexLock lock(&reg->mu);
    CancelLocked(reg.get(), "daemon shutting down");
  }
  // The engines finish (their destructors wait for their streams) as the
  // last references go.
}

void StepRegistry::WatchLoop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping_),
                               options_.watch_interval)) {
        return;
      }
    }
    Watch(absl::Now());
  }
}

absl::StatusOr<v1::RegisterWorkerResponse> StepRegistry::Register(
    const Caller& caller, const v1::RegisterWorkerRequest& request) {
  RETURN_IF_ERROR(RequireSession(caller));
  // Checked before the work and again when the registration is added:
  // registrations racing each other cannot pass the limits.
  auto room = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
    if (static_cast<int>(regs_.size()) >= options_.max_registrations) {
      return absl::ResourceExhaustedError(
          absl::StrCat("RegisterWorker: the daemon holds ", regs_.size(),
                       " registrations, its limit"));
    }
    int mine = 0;
    for (const auto& [id, reg] : regs_) {
      if (reg->owner.session == caller.session) ++mine;
    }
    if (mine >= options_.max_registrations_per_session) {
      return absl::ResourceExhaustedError(
          absl::StrCat("RegisterWorker: this session holds ", mine,
                       " registrations, its limit"));
    }
    return absl::OkStatus();
  };
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(room());
  }
  ASSIGN_OR_RETURN(RegistrationConfig config,
                   ResolveRegistration(request, caller, *pools_, *sessions_));
  auto reg = std::make_shared<Registration>();
  reg->owner = caller;
  reg->config = std::move(config);
  Registration* raw = reg.get();
  ASSIGN_OR_RETURN(
      reg->engine,
      factory_->Create(reg->config, [this, raw](const StepOutcome& o) {
        OnComplete(raw, o);
      }));
  v1::RegisterWorkerResponse out;
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(room());  // the engine goes with `reg`
    reg->id = next_id_++;
    regs_[reg->id] = reg;
    absl::MutexLock c(&counters_mu_);
    ++counters_.registrations;
  }
  out.set_registration_id(reg->id);
  out.set_doorbell_bytes(reg->config.doorbell_bytes);
  out.set_num_phases(static_cast<int32_t>(
      doorbell::NumPhases(static_cast<int64_t>(reg->config.layers.size()))));
  if (AdmitClientLog(ClientLog::kClientEvent, caller.log_client())) {
    spdlog::info("step: registration {} ({} layers) by session {}", reg->id,
                 reg->config.layers.size(), caller.session);
  }
  return out;
}

absl::StatusOr<std::shared_ptr<StepRegistry::Registration>> StepRegistry::Find(
    const Caller& caller, uint64_t id) const {
  RETURN_IF_ERROR(RequireSession(caller));
  std::shared_ptr<Registration> reg;
  {
    absl::MutexLock lock(&mu_);
    auto it = regs_.find(id);
    if (it != regs_.end()) reg = it->second;
  }
  if (reg == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("registration_id: no registration ", id));
  }
  bool allowed = caller.admin || caller.session == reg->owner.session;
  if (!allowed) {
    absl::MutexLock lock(&reg->mu);
    allowed = reg->acl.Allows(caller);
  }
  if (!allowed) {
    return absl::PermissionDeniedError(
        absl::StrCat("registration_id: registration ", id,
                     " is neither owned by nor granted to this session"));
  }
  return reg;
}

absl::Status StepRegistry::NotCancelled(const Registration& reg) {
  if (!reg.cancelled) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("registration ", reg.id, " was cancelled (",
                   reg.cancel_reason, "); unregister it and register again"));
}

absl::StatusOr<v1::StepResponse> StepRegistry::Step(
    const Caller& caller, const v1::StepRequest& request) {
  ASSIGN_OR_RETURN(std::shared_ptr<Registration> reg,
                   Find(caller, request.registration_id()));
  absl::MutexLock lock(&reg->mu);
  RETURN_IF_ERROR(NotCancelled(*reg));
  if (request.step_id() != reg->last_step_id + 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("step_id: ", request.step_id(), " is not the next step (",
                     reg->last_step_id + 1, ")"));
  }
  if (static_cast<int>(reg->deadlines.size()) >= kMaxInFlight) {
    absl::MutexLock c(&counters_mu_);
    ++counters_.steps_rejected_queue_full;
    return absl::ResourceExhaustedError(absl::StrCat(
        "step_id ", request.step_id(), ": ", kMaxInFlight,
        " steps of registration ", reg->id,
        " are in flight already; send it again when one finished"));
  }
  ASSIGN_OR_RETURN(StepPlan plan, BuildStepPlan(reg->config, request,
                                                options_.default_deadline));
  const absl::Time deadline = absl::Now() + plan.deadline;
  RETURN_IF_ERROR(reg->engine->Enqueue(std::move(plan)));
  reg->last_step_id = request.step_id();
  reg->deadlines.push_back(deadline);
  {
    absl::MutexLock c(&counters_mu_);
    ++counters_.steps_accepted;
  }
  v1::StepResponse out;
  out.set_step_id(request.step_id());
  out.set_queued(static_cast<int32_t>(reg->deadlines.size()));
  return out;
}

absl::StatusOr<v1::PlanStepResponse> StepRegistry::PlanStep(
    const Caller& caller, const v1::StepRequest& request) {
  ASSIGN_OR_RETURN(std::shared_ptr<Registration> reg,
                   Find(caller, request.registration_id()));
  {
    absl::MutexLock lock(&reg->mu);
    RETURN_IF_ERROR(NotCancelled(*reg));
  }
  // The configuration is immutable after registration: no lock needed.
  ASSIGN_OR_RETURN(StepPlan plan, BuildStepPlan(reg->config, request,
                                                options_.default_deadline));
  ASSIGN_OR_RETURN(v1::PlanStepResponse out,
                   ExportStepPlan(reg->config, std::move(plan)));
  absl::MutexLock c(&counters_mu_);
  ++counters_.steps_planned;
  return out;
}

void StepRegistry::OnComplete(Registration* reg, const StepOutcome& o) {
  absl::MutexLock lock(&reg->mu);
  if (!reg->deadlines.empty()) reg->deadlines.pop_front();
  reg->completed_step_id = o.step_id;
  reg->status_bits |= o.status_bits;
  const uint64_t new_oor = o.out_of_range > reg->out_of_range
                               ? o.out_of_range - reg->out_of_range
                               : 0;
  reg->out_of_range = std::max(reg->out_of_range, o.out_of_range);
  ++reg->steps_completed;
  reg->latency.Add(kStepLatencyBoundsUs, o.step_us);
  for (size_t p = 0; p < o.phase_us.size(); ++p) {
    // Phase 0 begins the step, then A (odd) and B (even) per layer.
    const size_t kind = p == 0 ? 0 : (p % 2 == 1 ? 1 : 2);
    reg->phase[kind].Add(kPhaseBoundsUs, o.phase_us[p]);
  }
  absl::MutexLock c(&counters_mu_);
  ++counters_.steps_completed;
  if (o.status_bits != 0) ++counters_.steps_with_status;
  if (o.graph_instantiated) ++counters_.graph_instantiations;
  counters_.out_of_range += static_cast<int64_t>(new_oor);
}

void StepRegistry::CancelLocked(Registration* reg, std::string reason) {
  if (reg->cancelled) return;
  reg->cancelled = true;
  reg->cancelled_at = absl::Now();
  reg->cancel_reason = std::move(reason);
  if (AdmitClientLog(ClientLog::kFailedCall, reg->owner.log_client())) {
    spdlog::warn("step: registration {} cancelled: {}", reg->id,
                 reg->cancel_reason);
  }
  reg->engine->Cancel();
}

absl::StatusOr<v1::RegistrationInfo> StepRegistry::Status(const Caller& caller,
                                                          uint64_t id) const {
  ASSIGN_OR_RETURN(std::shared_ptr<Registration> reg, Find(caller, id));
  return InfoOf(*reg);
}

absl::Status StepRegistry::Unregister(const Caller& caller, uint64_t id) {
  ASSIGN_OR_RETURN(std::shared_ptr<Registration> reg, Find(caller, id));
  if (!caller.admin && caller.session != reg->owner.session) {
    return absl::PermissionDeniedError(
        absl::StrCat("registration_id: only the owner of registration ", id,
                     " (or an admin) may unregister it"));
  }
  {
    absl::MutexLock lock(&reg->mu);
    if (!reg->deadlines.empty()) CancelLocked(reg.get(), "unregistered");
  }
  absl::MutexLock lock(&mu_);
  if (regs_.erase(id) == 1) {
    retired_.push_back(std::move(reg));
    absl::MutexLock c(&counters_mu_);
    --counters_.registrations;
  }
  return absl::OkStatus();
}

absl::Status StepRegistry::Grant(const Caller& caller,
                                 const v1::GrantRegistrationRequest& r) {
  ASSIGN_OR_RETURN(std::shared_ptr<Registration> reg,
                   Find(caller, r.registration_id()));
  if (!caller.admin && caller.session != reg->owner.session) {
    return absl::PermissionDeniedError(
        absl::StrCat("registration_id: only the owner of registration ",
                     r.registration_id(), " may grant it"));
  }
  if (r.uids_size() + r.sessions_size() == 0) {
    return absl::InvalidArgumentError("uids, sessions: both empty");
  }
  if (r.uids_size() + r.sessions_size() > 256) {
    return absl::InvalidArgumentError(
        "uids, sessions: more than 256 entries in one grant");
  }
  Acl grant;
  grant.uids.insert(r.uids().begin(), r.uids().end());
  grant.sessions.insert(r.sessions().begin(), r.sessions().end());
  absl::MutexLock lock(&reg->mu);
  RETURN_IF_ERROR(CheckGrantFits(
      reg->acl, grant, absl::StrCat("registration ", r.registration_id())));
  reg->acl.Merge(grant);
  return absl::OkStatus();
}

v1::RegistrationInfo StepRegistry::InfoOf(const Registration& reg) {
  v1::RegistrationInfo info;
  info.set_registration_id(reg.id);
  info.set_name(reg.config.name);
  info.set_owner_session(reg.owner.session);
  info.set_owner_uid(reg.owner.uid);
  info.set_num_layers(static_cast<int32_t>(reg.config.layers.size()));
  absl::MutexLock lock(&reg.mu);
  info.set_last_step_id(reg.last_step_id);
  info.set_completed_step_id(reg.completed_step_id);
  info.set_in_flight(static_cast<int32_t>(reg.deadlines.size()));
  info.set_status_bits(reg.status_bits);
  info.set_out_of_range(reg.out_of_range);
  info.set_cancelled(reg.cancelled);
  info.set_cancel_reason(reg.cancel_reason);
  info.set_steps_completed(reg.steps_completed);
  info.set_watchdog_expiries(reg.watchdog_expiries);
  Histogram layer_phases = reg.phase[1];
  layer_phases.Merge(reg.phase[2]);
  info.set_handoff_p50_us(layer_phases.Quantile(kPhaseBoundsUs, 0.5));
  return info;
}

std::vector<v1::RegistrationInfo> StepRegistry::List(
    const Caller& caller) const {
  std::vector<std::shared_ptr<Registration>> all;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, reg] : regs_) all.push_back(reg);
  }
  std::vector<v1::RegistrationInfo> out;
  if (!caller.authenticated()) return out;
  for (const auto& reg : all) {
    bool visible = caller.admin || caller.session == reg->owner.session;
    if (!visible) {
      absl::MutexLock lock(&reg->mu);
      visible = reg->acl.Allows(caller);
    }
    if (visible) out.push_back(InfoOf(*reg));
  }
  return out;
}

void StepRegistry::Watch(absl::Time now) {
  std::vector<std::shared_ptr<Registration>> all;
  std::vector<std::shared_ptr<Registration>> dead;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, reg] : regs_) all.push_back(reg);
    // Retired registrations with nothing in flight are destroyed here.
    std::vector<std::shared_ptr<Registration>> keep;
    for (auto& reg : retired_) {
      absl::MutexLock r(&reg->mu);
      (reg->deadlines.empty() ? dead : keep).push_back(reg);
    }
    retired_.swap(keep);
  }
  dead.clear();  // engine destructors run here, off every gRPC thread
  int64_t expiries = 0;
  int64_t cancels = 0;
  std::vector<uint64_t> gone;  // dead owners, cancelled, nothing in flight
  for (const auto& reg : all) {
    // The owner's session ends with its companion connection; its buffers
    // (the doorbell among them) go with it.
    const bool alive =
        sessions_->GetBuffer(reg->owner, "doorbell", reg->config.doorbell->id)
            .ok();
    absl::MutexLock lock(&reg->mu);
    if (reg->cancelled) {
      if (!alive && reg->deadlines.empty() &&
          now - reg->cancelled_at > options_.dead_retention) {
        gone.push_back(reg->id);
      }
      continue;
    }
    if (!alive) {
      CancelLocked(reg.get(), "the worker's session closed");
      ++cancels;
    } else if (!reg->deadlines.empty() && reg->deadlines.front() < now) {
      ++reg->watchdog_expiries;
      ++expiries;
      ++cancels;
      CancelLocked(reg.get(), absl::StrCat("step ", reg->completed_step_id + 1,
                                           " passed its deadline (watchdog)"));
    }
  }
  absl::MutexLock lock(&mu_);
  absl::MutexLock c(&counters_mu_);
  counters_.watchdog_expiries += expiries;
  counters_.cancels += cancels;
  for (uint64_t id : gone) {
    auto it = regs_.find(id);
    if (it == regs_.end()) continue;
    retired_.push_back(std::move(it->second));
    regs_.erase(it);
    --counters_.registrations;
  }
}

std::string StepRegistry::RenderPrometheus() const {
  const StepCounters c = Counters();
  std::string out;
  auto counter = [&out](const char* name, const char* help, int64_t v,
                        const char* type = "counter") {
    absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ",
                    type, "\n", name, " ", v, "\n");
  };
  counter("kvdepot_step_registrations", "Live step-path registrations.",
          c.registrations, "gauge");
  counter("kvdepot_steps_accepted_total", "Step requests accepted.",
          c.steps_accepted);
  counter("kvdepot_steps_completed_total", "Steps finished on the GPU.",
          c.steps_completed);
  counter("kvdepot_steps_rejected_queue_full_total",
          "Steps refused with two in flight.", c.steps_rejected_queue_full);
  counter("kvdepot_steps_with_status_total",
          "Steps that finished with a status bit set.", c.steps_with_status);
  counter("kvdepot_step_cancels_total",
          "Registrations cancelled (watchdog or closed session).", c.cancels);
  counter("kvdepot_step_watchdog_expiries_total",
          "Steps that passed their deadline.", c.watchdog_expiries);
  counter("kvdepot_step_out_of_range_total",
          "Device-resident entries the kernels turned into -1.",
          c.out_of_range);
  counter("kvdepot_step_graph_instantiations_total",
          "Steps whose CUDA graph was instantiated anew (a new batch shape) "
          "instead of updated in place.",
          c.graph_instantiations);
  counter("kvdepot_steps_planned_total",
          "PlanStep replies (library mode on daemon-built metadata).",
          c.steps_planned);
  // Per registration: a snapshot of each under its own lock, then one group
  // of lines per metric family (the text format wants families whole).
  struct Row {
    std::string label;  // registration="<id>",name="<escaped>"
    uint64_t in_flight, status_bits, out_of_range, steps_completed,
        last_step_id, completed_step_id, watchdog_expiries, cancelled;
    Histogram latency;
    std::array<Histogram, 3> phase;
  };
  std::vector<Row> rows;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, reg] : regs_) {
      absl::MutexLock r(&reg->mu);
      rows.push_back({absl::StrCat("registration=\"", reg->id, "\",name=\"",
                                   PrometheusLabel(reg->config.name), "\""),
                      reg->deadlines.size(), reg->status_bits,
                      reg->out_of_range, reg->steps_completed,
                      reg->last_step_id, reg->completed_step_id,
                      reg->watchdog_expiries, reg->cancelled ? 1u : 0u,
                      reg->latency, reg->phase});
    }
  }
  if (rows.empty()) return out;
  auto family = [&](const char* name, const char* help, const char* type,
                    uint64_t Row::*field) {
    absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ",
                    type, "\n");
    for (const Row& row : rows) {
      absl::StrAppend(&out, name, "{", row.label, "} ", row.*field, "\n");
    }
  };
  family("kvdepot_step_in_flight", "Steps in flight.", "gauge",
         &Row::in_flight);
  family("kvdepot_step_status_bits",
         "Sticky doorbell status bits (docs/STEP_PATH.md).", "gauge",
         &Row::status_bits);
  family("kvdepot_step_registration_out_of_range",
         "Device-resident entries the kernels turned into -1.", "gauge",
         &Row::out_of_range);
  family("kvdepot_step_registration_completed_total",
         "Steps of the registration finished on the GPU.", "counter",
         &Row::steps_completed);
  family("kvdepot_step_last_accepted_id", "Last step id accepted.", "gauge",
         &Row::last_step_id);
  family("kvdepot_step_last_finished_id", "Last step id finished.", "gauge",
         &Row::completed_step_id);
  family("kvdepot_step_registration_watchdog_expiries_total",
         "Steps of the registration that passed their deadline.", "counter",
         &Row::watchdog_expiries);
  family("kvdepot_step_cancelled",
         "1 once the registration was cancelled (terminal).", "gauge",
         &Row::cancelled);
  absl::StrAppend(&out,
                  "# HELP kvdepot_step_latency_us Host-seen step time.\n"
                  "# TYPE kvdepot_step_latency_us histogram\n");
  for (const Row& row : rows) {
    AppendHistogram(&out, "kvdepot_step_latency_us", row.label,
                    kStepLatencyBoundsUs, row.latency);
  }
  absl::StrAppend(&out,
                  "# HELP kvdepot_step_phase_us GPU time of a phase of the "
                  "timed steps (--step_timing_every), from the daemon's "
                  "stream passing the worker's flag to the end of the "
                  "phase's kernels.\n"
                  "# TYPE kvdepot_step_phase_us histogram\n");
  constexpr const char* kKinds[3] = {"begin", "A", "B"};
  for (const Row& row : rows) {
    for (int k = 0; k < 3; ++k) {
      AppendHistogram(&out, "kvdepot_step_phase_us",
                      absl::StrCat(row.label, ",phase=\"", kKinds[k], "\""),
                      kPhaseBoundsUs, row.phase[k]);
    }
  }
  return out;
}

StepCounters StepRegistry::Counters() const {
  absl::MutexLock lock(&counters_mu_);
  return counters_;
}

}  // namespace kvdepot::step
