// Offline checks of a rendered kustomize overlay (the output of
// `kubectl kustomize deploy/k8s/overlays/NAME`), no cluster needed:
//
//   node check.mjs schema  OVERLAY RENDERED.yaml  every object against the
//       Kubernetes OpenAPI schemas (kubernetes-models) and the
//       prometheus-operator CRDs, plus the references between objects
//       (volumes, ConfigMaps, Service and ServiceMonitor selectors);
//   node check.mjs policy  OVERLAY RENDERED.yaml  the restricted Pod Security
//       Standard on every pod template, the kvcached probes, drain timing,
//       metrics and socket wiring;
//   node check.mjs selftest OVERLAY RENDERED.yaml  breaks the rendered objects
//       one way at a time and expects each check to name the breakage.
//   node check.mjs probe-argv OVERLAY RENDERED.yaml  prints the kvcached
//       probe's argv, one element per line (for the live probe test);
//   node check.mjs daemon-args OVERLAY RENDERED.yaml  prints the kvcached
//       container's args, one per line (ditto).
//
// Exit 0 when everything holds; 1 with one line per problem otherwise.
import { readFileSync } from "node:fs";
import yaml from "js-yaml";

// The probe command every kvcached container must run (/tmp/iface.md,
// docs/DEPLOY.md): exit 0 only while the daemon's health is SERVING.
export const SOCKET_DIR = "/run/kvcached";
export const PROBE_ARGV = [
  "kvcachectl", "status", "--addr", `unix:${SOCKET_DIR}/kvcached.sock`,
];
const KVCACHED_UID = 65532; // deploy/docker/Dockerfile
const METRICS_PORT = 9400;
const DRAIN_TIMEOUT_DEFAULT_S = 30; // kvcached --drain_timeout_s
const DRAIN_GRACE_DEFAULT_MS = 200; // kvcached --drain_grace_ms
const DRAIN_MARGIN_S = 5;           // SIGKILL comes no sooner than this after
const CTL_TIMEOUT_S = 5;            // kvcachectl --timeout default
// Volume types the restricted Pod Security Standard allows.
const RESTRICTED_VOLUMES = new Set([
  "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
  "persistentVolumeClaim", "projected", "secret",
]);
const WORKLOAD_KINDS = new Set([
  "Deployment", "DaemonSet", "StatefulSet", "Job", "ReplicaSet",
]);

export function loadDocs(text) {
  return yaml.loadAll(text).filter((d) => d !== null && d !== undefined);
}

function where(obj) {
  return `${obj.kind}/${obj.metadata?.name ?? "?"}`;
}

// --- schema ---------------------------------------------------------------

async function modelFor(apiVersion, kind) {
  let mod;
  if (apiVersion === "monitoring.coreos.com/v1") {
    mod = `@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/${kind}`;
  } else if (/^[a-z0-9.]*\/?v[0-9a-z]+$/.test(apiVersion)) {
    mod = `kubernetes-models/${apiVersion}/${kind}`;
  } else {
    return null;
  }
  try {
    return (await import(mod))[kind] ?? null;
  } catch {
    return null;
  }
}

export async function checkSchema(docs) {
  const errors = [];
  for (const obj of docs) {
    const Model = await modelFor(obj.apiVersion, obj.kind);
    if (Model === null) {
      errors.push(`${where(obj)}: no schema for apiVersion ${obj.apiVersion} kind ${obj.kind}`);
      continue;
    }
    try {
      new Model(obj).validate();
    } catch (e) {
      errors.push(`${where(obj)}: schema: ${e.message}`);
    }
  }
  errors.push(...checkReferences(docs));
  return errors;
}

function labelsMatch(selector, labels) {
  const want = Object.entries(selector ?? {});
  return want.length > 0 && want.every(([k, v]) => labels?.[k] === v);
}

// References between objects that the schemas cannot see.
export function checkReferences(docs) {
  const errors = [];
  const configMaps = new Set(
    docs.filter((d) => d.kind === "ConfigMap").map((d) => d.metadata.name));
  const workloads = docs.filter((d) => WORKLOAD_KINDS.has(d.kind));
  for (const w of workloads) {
    const t = w.spec.template;
    if (!labelsMatch(w.spec.selector?.matchLabels, t.metadata?.labels)) {
      errors.push(`${where(w)}: spec.selector does not match the pod template's labels`);
    }
    const spec = t.spec;
    const volumes = new Map((spec.volumes ?? []).map((v) => [v.name, v]));
    for (const v of spec.volumes ?? []) {
      if (v.configMap && !configMaps.has(v.configMap.name)) {
        errors.push(`${where(w)}: volume ${v.name} names ConfigMap ${v.configMap.name}, ` +
                    `which the overlay does not contain`);
      }
    }
    for (const c of [...(spec.initContainers ?? []), ...spec.containers]) {
      for (const m of c.volumeMounts ?? []) {
        if (!volumes.has(m.name)) {
          errors.push(`${where(w)}: container ${c.name} mounts unknown volume ${m.name}`);
        }
      }
    }
  }
  const services = docs.filter((d) => d.kind === "Service");
  for (const s of services) {
    const targets = workloads.filter(
      (w) => labelsMatch(s.spec.selector, w.spec.template.metadata?.labels));
    if (targets.length === 0) {
      errors.push(`${where(s)}: selector matches no pod template`);
    }
    for (const p of s.spec.ports ?? []) {
      if (typeof p.targetPort !== "string") continue;
      const named = targets.some((w) => allContainers(w.spec.template.spec).some(
        (c) => (c.ports ?? []).some((cp) => cp.name === p.targetPort)));
      if (!named) errors.push(`${where(s)}: targetPort ${p.targetPort} is no container port`);
    }
  }
  for (const m of docs.filter((d) => d.kind === "ServiceMonitor")) {
    const s = services.find((x) => labelsMatch(m.spec.selector?.matchLabels, x.metadata.labels));
    if (!s) {
      errors.push(`${where(m)}: selector matches no Service`);
      continue;
    }
    for (const e of m.spec.endpoints ?? []) {
      if (!(s.spec.ports ?? []).some((p) => p.name === e.port)) {
        errors.push(`${where(m)}: endpoint port ${e.port} is not a port of ${where(s)}`);
      }
    }
  }
  return errors;
}

// --- policy ---------------------------------------------------------------

function allContainers(spec) {
  return [...(spec.initContainers ?? []), ...(spec.containers ?? [])];
}

function isKvcached(c) {
  return c.name === "kvcached";
}

function flagValue(args, name) {
  const prefix = `--${name}=`;
  const a = (args ?? []).find((x) => x.startsWith(prefix));
  return a === undefined ? undefined : a.slice(prefix.length);
}

function sameArgv(a, b) {
  return Array.isArray(a) && a.length === b.length && a.every((x, i) => x === b[i]);
}

function checkContainerPss(ctx, c, podSc, errors) {
  const sc = c.securityContext ?? {};
  const at = `${ctx}: container ${c.name}`;
  if (sc.privileged === true) errors.push(`${at}: privileged`);
  if (sc.allowPrivilegeEscalation !== false) {
    errors.push(`${at}: securityContext.allowPrivilegeEscalation must be false`);
  }
  const drop = sc.capabilities?.drop ?? [];
  if (!drop.includes("ALL")) errors.push(`${at}: securityContext.capabilities.drop must include ALL`);
  for (const add of sc.capabilities?.add ?? []) {
    if (add !== "NET_BIND_SERVICE") errors.push(`${at}: securityContext.capabilities.add ${add}`);
  }
  if (sc.readOnlyRootFilesystem !== true) {
    errors.push(`${at}: securityContext.readOnlyRootFilesystem must be true`);
  }
  const nonRoot = sc.runAsNonRoot ?? podSc.runAsNonRoot;
  if (nonRoot !== true) errors.push(`${at}: runAsNonRoot must be true (pod or container)`);
  const uid = sc.runAsUser ?? podSc.runAsUser;
  if (uid === 0) errors.push(`${at}: runAsUser 0`);
  const seccomp = sc.seccompProfile?.type ?? podSc.seccompProfile?.type;
  if (seccomp !== "RuntimeDefault" && seccomp !== "Localhost") {
    errors.push(`${at}: seccompProfile.type must be RuntimeDefault (pod or container), got ${seccomp}`);
  }
  for (const p of c.ports ?? []) {
    if (p.hostPort !== undefined) errors.push(`${at}: hostPort ${p.hostPort}`);
  }
  if (sc.readOnlyRootFilesystem === true &&
      !(c.volumeMounts ?? []).some((m) => m.mountPath === "/tmp")) {
    errors.push(`${at}: read-only root filesystem without a /tmp volume`);
  }
}

function mountOf(c, path) {
  return (c.volumeMounts ?? []).find((m) => m.mountPath === path);
}

function checkKvcached(ctx, w, c, isInit, overlay, errors) {
  const spec = w.spec.template.spec;
  const at = `${ctx}: container ${c.name}`;
  for (const kind of ["startupProbe", "readinessProbe", "livenessProbe"]) {
    const p = c[kind];
    if (!p) {
      errors.push(`${at}: no ${kind}`);
      continue;
    }
    if (!sameArgv(p.exec?.command, PROBE_ARGV)) {
      errors.push(`${at}: ${kind}.exec.command is ${JSON.stringify(p.exec?.command)}, ` +
                  `want ${JSON.stringify(PROBE_ARGV)}`);
    }
    if (!((p.timeoutSeconds ?? 1) > CTL_TIMEOUT_S)) {
      errors.push(`${at}: ${kind}.timeoutSeconds ${p.timeoutSeconds ?? 1} does not exceed ` +
                  `kvcachectl's own ${CTL_TIMEOUT_S} s timeout`);
    }
  }
  const sc = c.securityContext ?? {};
  const podSc = spec.securityContext ?? {};
  if ((sc.runAsUser ?? podSc.runAsUser) !== KVCACHED_UID ||
      (sc.runAsGroup ?? podSc.runAsGroup) !== KVCACHED_UID) {
    errors.push(`${at}: runAsUser/runAsGroup must be ${KVCACHED_UID} (the image's user)`);
  }
  const socketMount = mountOf(c, SOCKET_DIR);
  if (!socketMount) errors.push(`${at}: ${SOCKET_DIR} is not mounted`);
  const shm = mountOf(c, "/dev/shm");
  const shmVol = shm && (spec.volumes ?? []).find((v) => v.name === shm.name);
  if (shmVol?.emptyDir?.medium !== "Memory") {
    errors.push(`${at}: /dev/shm must be a memory-backed emptyDir`);
  }
  const cfg = mountOf(c, "/etc/kvcached");
  const cfgVol = cfg && (spec.volumes ?? []).find((v) => v.name === cfg.name);
  if (!cfgVol?.configMap) errors.push(`${at}: /etc/kvcached is not a ConfigMap volume`);
  if (flagValue(c.args, "config") !== "/etc/kvcached/kvcached.textproto") {
    errors.push(`${at}: --config=/etc/kvcached/kvcached.textproto missing`);
  }
  if (flagValue(c.args, "metrics_address") !== `0.0.0.0:${METRICS_PORT}`) {
    errors.push(`${at}: --metrics_address=0.0.0.0:${METRICS_PORT} missing`);
  }
  if (!(c.ports ?? []).some((p) => p.containerPort === METRICS_PORT && p.name === "metrics")) {
    errors.push(`${at}: no container port "metrics" ${METRICS_PORT}`);
  }
  const ann = w.spec.template.metadata?.annotations ?? {};
  if (ann["prometheus.io/scrape"] !== "true" || ann["prometheus.io/port"] !== `${METRICS_PORT}`) {
    errors.push(`${ctx}: prometheus.io/scrape and prometheus.io/port annotations missing`);
  }
  const drainS = Number(flagValue(c.args, "drain_timeout_s") ?? DRAIN_TIMEOUT_DEFAULT_S);
  const graceMs = Number(flagValue(c.args, "drain_grace_ms") ?? DRAIN_GRACE_DEFAULT_MS);
  const need = drainS + Math.ceil(graceMs / 1000) + DRAIN_MARGIN_S;
  const tgp = spec.terminationGracePeriodSeconds ?? 30;
  if (!(tgp >= need)) {
    errors.push(`${ctx}: terminationGracePeriodSeconds ${tgp} is shorter than the drain ` +
                `(${drainS} s + ${graceMs} ms) + ${DRAIN_MARGIN_S} s margin = ${need} s`);
  }
  if (overlay === "sidecar") {
    if (!isInit || c.restartPolicy !== "Always") {
      errors.push(`${at}: a native sidecar is an initContainers entry with restartPolicy: Always`);
    }
    for (const other of spec.containers) {
      const m = mountOf(other, SOCKET_DIR);
      if (!m || m.name !== socketMount?.name) {
        errors.push(`${ctx}: container ${other.name} does not share ${SOCKET_DIR} with kvcached`);
      }
      const s = mountOf(other, "/dev/shm");
      if (!s || s.name !== shm?.name) {
        errors.push(`${ctx}: container ${other.name} does not share /dev/shm with kvcached`);
      }
    }
    const gpus = allContainers(spec).some((x) => x.resources?.limits?.["nvidia.com/gpu"]);
    if (!gpus) errors.push(`${ctx}: no container requests nvidia.com/gpu`);
  }
}

function checkHostPath(ctx, v, overlay, errors) {
  if (overlay === "daemonset" && v.name === "kvcached-socket" &&
      v.hostPath.path === SOCKET_DIR && v.hostPath.type === "Directory") {
    return; // the one documented exception (overlays/daemonset)
  }
  errors.push(`${ctx}: volume ${v.name}: hostPath is not allowed by the restricted standard`);
}

export function checkPolicy(docs, overlay) {
  const errors = [];
  const ns = docs.filter((d) => d.kind === "Namespace");
  const wantEnforce = overlay === "daemonset" ? "privileged" : "restricted";
  if (ns.length !== 1) errors.push(`expected one Namespace, found ${ns.length}`);
  for (const n of ns) {
    const l = n.metadata.labels ?? {};
    if (l["pod-security.kubernetes.io/enforce"] !== wantEnforce) {
      errors.push(`${where(n)}: pod-security.kubernetes.io/enforce must be ${wantEnforce}`);
    }
    for (const mode of ["warn", "audit"]) {
      if (l[`pod-security.kubernetes.io/${mode}`] !== "restricted") {
        errors.push(`${where(n)}: pod-security.kubernetes.io/${mode} must be restricted`);
      }
    }
  }
  const workloads = docs.filter((d) => WORKLOAD_KINDS.has(d.kind));
  let daemons = 0;
  let workers = 0;
  for (const w of workloads) {
    const ctx = where(w);
    const spec = w.spec.template.spec;
    const podSc = spec.securityContext ?? {};
    for (const f of ["hostNetwork", "hostPID", "hostIPC"]) {
      if (spec[f] === true) errors.push(`${ctx}: ${f}`);
    }
    if (spec.automountServiceAccountToken !== false) {
      errors.push(`${ctx}: automountServiceAccountToken must be false (no API access needed)`);
    }
    for (const v of spec.volumes ?? []) {
      const type = Object.keys(v).find((k) => k !== "name");
      if (type === "hostPath") checkHostPath(ctx, v, overlay, errors);
      else if (!RESTRICTED_VOLUMES.has(type)) errors.push(`${ctx}: volume ${v.name}: type ${type}`);
    }
    const inits = spec.initContainers ?? [];
    for (const c of allContainers(spec)) {
      checkContainerPss(ctx, c, podSc, errors);
      if (!/^[a-z0-9.-]+(:[0-9]+)?\/[^:@]+(:[A-Za-z0-9._-]+|@sha256:[0-9a-f]{64})$/.test(c.image) ||
          c.image.endsWith(":latest")) {
        errors.push(`${ctx}: container ${c.name}: image ${c.image} is not a pinned registry image`);
      }
      if (isKvcached(c)) {
        daemons++;
        checkKvcached(ctx, w, c, inits.includes(c), overlay, errors);
      } else if (c.name === "worker") {
        workers++;
        if (!mountOf(c, SOCKET_DIR)) errors.push(`${ctx}: worker does not mount ${SOCKET_DIR}`);
        const groups = podSc.supplementalGroups ?? [];
        const gid = c.securityContext?.runAsGroup ?? podSc.runAsGroup;
        if (gid !== KVCACHED_UID && !groups.includes(KVCACHED_UID)) {
          errors.push(`${ctx}: worker is not in group ${KVCACHED_UID} (supplementalGroups)`);
        }
      }
    }
  }
  if (daemons === 0) errors.push("no kvcached container in any pod template");
  if (workers === 0) errors.push("no worker container in any pod template");
  if (overlay === "daemonset") {
    if (!workloads.some((w) => w.kind === "DaemonSet" &&
                       w.spec.template.spec.containers.some(isKvcached))) {
      errors.push("daemonset: kvcached is not a DaemonSet");
    }
    if (!docs.some((d) => d.kind === "ServiceMonitor")) errors.push("daemonset: no ServiceMonitor");
  }
  return errors;
}

export function daemonArgs(docs) {
  for (const w of docs.filter((d) => WORKLOAD_KINDS.has(d.kind))) {
    const c = allContainers(w.spec.template.spec).find(isKvcached);
    if (c) return c.args ?? [];
  }
  return null;
}

export function probeArgv(docs) {
  for (const w of docs.filter((d) => WORKLOAD_KINDS.has(d.kind))) {
    const c = allContainers(w.spec.template.spec).find(isKvcached);
    if (c?.readinessProbe?.exec?.command) return c.readinessProbe.exec.command;
  }
  return null;
}

// --- selftest -------------------------------------------------------------

function kvcachedOf(docs) {
  for (const w of docs.filter((d) => WORKLOAD_KINDS.has(d.kind))) {
    const c = allContainers(w.spec.template.spec).find(isKvcached);
    if (c) return { w, c };
  }
  throw new Error("no kvcached container");
}

function workerOf(docs) {
  for (const w of docs.filter((d) => WORKLOAD_KINDS.has(d.kind))) {
    const c = w.spec.template.spec.containers.find((x) => x.name === "worker");
    if (c) return { w, c };
  }
  throw new Error("no worker container");
}

// Each mutation breaks one rule; the check must report it by `want`.
const MUTATIONS = [
  ["schema", "image must be string", (d) => { kvcachedOf(d).c.image = 7; }],
  ["schema", "must be integer", (d) => { kvcachedOf(d).w.spec.template.spec.terminationGracePeriodSeconds = "45"; }],
  ["schema", "which the overlay does not contain", (d) => {
    const cm = d.find((x) => x.kind === "ConfigMap");
    cm.metadata.name += "-stale";
  }],
  ["schema", "mounts unknown volume", (d) => { kvcachedOf(d).c.volumeMounts[0].name = "nope"; }],
  ["schema", "selector does not match", (d) => { kvcachedOf(d).w.spec.template.metadata.labels = { a: "b" }; }],
  ["policy", "allowPrivilegeEscalation must be false", (d) => {
    delete workerOf(d).c.securityContext.allowPrivilegeEscalation;
  }],
  ["policy", "capabilities.drop must include ALL", (d) => { kvcachedOf(d).c.securityContext.capabilities.drop = ["NET_RAW"]; }],
  ["policy", "readOnlyRootFilesystem must be true", (d) => { kvcachedOf(d).c.securityContext.readOnlyRootFilesystem = false; }],
  ["policy", "runAsNonRoot must be true", (d) => { delete workerOf(d).w.spec.template.spec.securityContext.runAsNonRoot; }],
  ["policy", "seccompProfile.type must be RuntimeDefault", (d) => {
    kvcachedOf(d).c.securityContext.seccompProfile = { type: "Unconfined" };
  }],
  ["policy", "hostPID", (d) => { workerOf(d).w.spec.template.spec.hostPID = true; }],
  ["policy", "hostPath is not allowed", (d) => {
    workerOf(d).w.spec.template.spec.volumes.push({ name: "h", hostPath: { path: "/var" } });
  }],
  ["policy", "readinessProbe.exec.command is", (d) => { kvcachedOf(d).c.readinessProbe.exec.command[1] = "ping"; }],
  ["policy", "no livenessProbe", (d) => { delete kvcachedOf(d).c.livenessProbe; }],
  ["policy", "startupProbe.timeoutSeconds 5 does not exceed", (d) => { kvcachedOf(d).c.startupProbe.timeoutSeconds = 5; }],
  ["policy", "terminationGracePeriodSeconds 30 is shorter than the drain", (d) => {
    kvcachedOf(d).w.spec.template.spec.terminationGracePeriodSeconds = 30;
  }],
  ["policy", "= 96 s", (d) => {
    const { c } = kvcachedOf(d);
    c.args = c.args.map((a) => (a.startsWith("--drain_timeout_s=") ? "--drain_timeout_s=90" : a));
  }],
  ["policy", "/dev/shm must be a memory-backed emptyDir", (d) => {
    const { w, c } = kvcachedOf(d);
    const name = mountOf(c, "/dev/shm").name;
    w.spec.template.spec.volumes.find((v) => v.name === name).emptyDir = {};
  }],
  ["policy", "--metrics_address=0.0.0.0:9400 missing", (d) => {
    const { c } = kvcachedOf(d);
    c.args = c.args.filter((a) => !a.startsWith("--metrics_address="));
  }],
  ["policy", "is not a pinned registry image", (d) => { workerOf(d).c.image = "llm-worker"; }],
  ["policy", "worker is not in group 65532", (d) => {
    workerOf(d).w.spec.template.spec.securityContext.supplementalGroups = [];
  }],
  ["policy", "enforce must be", (d) => {
    d.find((x) => x.kind === "Namespace").metadata.labels["pod-security.kubernetes.io/enforce"] = "baseline";
  }],
];
const SIDECAR_MUTATIONS = [
  ["policy", "initContainers entry with restartPolicy: Always", (d) => { delete kvcachedOf(d).c.restartPolicy; }],
  ["policy", "does not share /dev/shm with kvcached", (d) => {
    const { c } = workerOf(d);
    c.volumeMounts = c.volumeMounts.filter((m) => m.mountPath !== "/dev/shm");
  }],
  ["policy", "no container requests nvidia.com/gpu", (d) => { delete workerOf(d).c.resources.limits["nvidia.com/gpu"]; }],
];
const DAEMONSET_MUTATIONS = [
  ["schema", "endpoint port metrix", (d) => { d.find((x) => x.kind === "ServiceMonitor").spec.endpoints[0].port = "metrix"; }],
  ["schema", "selector matches no pod template", (d) => { d.find((x) => x.kind === "Service").spec.selector = { a: "b" }; }],
  ["policy", "hostPath is not allowed", (d) => {
    const { w } = kvcachedOf(d);
    w.spec.template.spec.volumes.find((v) => v.hostPath).hostPath.type = "DirectoryOrCreate";
  }],
  ["policy", "no ServiceMonitor", (d) => { d.splice(d.findIndex((x) => x.kind === "ServiceMonitor"), 1); }],
];

async function selftest(text, overlay) {
  const failures = [];
  const all = [...MUTATIONS,
    ...(overlay === "sidecar" ? SIDECAR_MUTATIONS : []),
    ...(overlay === "daemonset" ? DAEMONSET_MUTATIONS : [])];
  for (const [check, want, mutate] of all) {
    const docs = loadDocs(text);
    mutate(docs);
    const errors = check === "schema" ? await checkSchema(docs) : checkPolicy(docs, overlay);
    if (!errors.some((e) => e.includes(want))) {
      failures.push(`mutation "${want}" was not reported by ${check}; got: ${JSON.stringify(errors)}`);
    }
  }
  console.log(`selftest ${overlay}: ${all.length - failures.length} of ${all.length} mutations caught`);
  return failures;
}

async function main() {
  const [mode, overlay, file] = process.argv.slice(2);
  if (!mode || !overlay || !file) {
    console.error("usage: node check.mjs schema|policy|selftest|probe-argv|daemon-args OVERLAY RENDERED.yaml");
    process.exit(2);
  }
  const text = readFileSync(file, "utf8");
  const docs = loadDocs(text);
  if (docs.length === 0) {
    console.error(`${file}: no objects`);
    process.exit(1);
  }
  let errors;
  if (mode === "schema") errors = await checkSchema(docs);
  else if (mode === "policy") errors = checkPolicy(docs, overlay);
  else if (mode === "selftest") {
    // The unmodified objects must pass, or the mutations prove nothing.
    errors = [...await checkSchema(docs), ...checkPolicy(docs, overlay)];
    if (errors.length === 0) errors = await selftest(text, overlay);
  } else if (mode === "probe-argv" || mode === "daemon-args") {
    const list = mode === "probe-argv" ? probeArgv(docs) : daemonArgs(docs);
    if (list === null) errors = [`no kvcached ${mode}`];
    else {
      process.stdout.write(list.map((x) => `${x}\n`).join(""));
      errors = [];
    }
  } else {
    console.error(`unknown mode ${mode}`);
    process.exit(2);
  }
  for (const e of errors) console.error(`${overlay}: ${e}`);
  if (mode !== "probe-argv" && mode !== "daemon-args") {
    console.error(`${mode} ${overlay}: ${docs.length} objects, ${errors.length} problems`);
  }
  process.exit(errors.length === 0 ? 0 : 1);
}

await main();
