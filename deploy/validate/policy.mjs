// Policy checks of rendered pod templates: the restricted Pod Security
// Standard, the kvdepot probes, drain timing, metrics and socket wiring.
import {
  CTL_TIMEOUT_S, DRAIN_GRACE_DEFAULT_MS, DRAIN_MARGIN_S, DRAIN_TIMEOUT_DEFAULT_S,
  GPU_DEVICE_CLASS, KVDEPOT_UID, METRICS_PORT, PROBE_ARGV, RESTRICTED_VOLUMES, SOCKET_DIR,
  WORKLOAD_KINDS, allContainers, flagValue, isKvdepot, mountOf, sameArgv, where,
} from "./common.mjs";

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

function checkKvdepot(ctx, w, c, isInit, overlay, docs, errors) {
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
  if ((sc.runAsUser ?? podSc.runAsUser) !== KVDEPOT_UID ||
      (sc.runAsGroup ?? podSc.runAsGroup) !== KVDEPOT_UID) {
    errors.push(`${at}: runAsUser/runAsGroup must be ${KVDEPOT_UID} (the image's user)`);
  }
  const socketMount = mountOf(c, SOCKET_DIR);
  if (!socketMount) errors.push(`${at}: ${SOCKET_DIR} is not mounted`);
  const shm = mountOf(c, "/dev/shm");
  const shmVol = shm && (spec.volumes ?? []).find((v) => v.name === shm.name);
  if (shmVol?.emptyDir?.medium !== "Memory") {
    errors.push(`${at}: /dev/shm must be a memory-backed emptyDir`);
  }
  const cfg = mountOf(c, "/etc/kvdepot");
  const cfgVol = cfg && (spec.volumes ?? []).find((v) => v.name === cfg.name);
  if (!cfgVol?.configMap) errors.push(`${at}: /etc/kvdepot is not a ConfigMap volume`);
  if (flagValue(c.args, "config") !== "/etc/kvdepot/kvdepotd.textproto") {
    errors.push(`${at}: --config=/etc/kvdepot/kvdepotd.textproto missing`);
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
        errors.push(`${ctx}: container ${other.name} does not share ${SOCKET_DIR} with kvdepot`);
      }
      const s = mountOf(other, "/dev/shm");
      if (!s || s.name !== shm?.name) {
        errors.push(`${ctx}: container ${other.name} does not share /dev/shm with kvdepot`);
      }
    }
    checkSharedGpu(ctx, w, c, docs, errors);
  }
}

// The sidecar overlay: kvdepot and every worker container share one GPU
// through the same DRA claim (a ResourceClaimTemplate asking for exactly
// one device of NVIDIA's class), kvdepot runs the CUDA backend with its
// pools on that GPU, and no container asks the device plugin for another.
function checkSharedGpu(ctx, w, c, docs, errors) {
  const spec = w.spec.template.spec;
  const at = `${ctx}: container ${c.name}`;
  const backend = flagValue(c.args, "backend") ?? "auto";
  if (backend !== "cuda" && backend !== "auto") {
    errors.push(`${at}: --backend=${backend}; the sidecar shares the pod's GPU, want cuda or auto`);
  }
  // CUDA pools are VMM allocations handed over as descriptors; legacy CUDA
  // IPC handles are bearer tokens anyone who sees them can open (SPEC §11).
  if ((c.args ?? []).includes("--legacy_cuda_ipc")) {
    errors.push(`${at}: --legacy_cuda_ipc shares GPU memory by bearer tokens; manifests must use the descriptor path`);
  }
  if (flagValue(c.args, "socket_group") !== `${KVDEPOT_UID}`) {
    errors.push(`${at}: --socket_group=${KVDEPOT_UID} missing; workers reach the sockets through that group`);
  }
  const mine = (c.resources?.claims ?? []).map((x) => x.name);
  if (mine.length === 0) errors.push(`${at}: resources.claims is empty: kvdepot has no GPU claim`);
  for (const other of spec.containers) {
    const theirs = new Set((other.resources?.claims ?? []).map((x) => x.name));
    for (const name of mine) {
      if (!theirs.has(name)) {
        errors.push(`${ctx}: container ${other.name} does not share GPU claim ${name} with kvdepot`);
      }
    }
  }
  for (const x of allContainers(spec)) {
    for (const part of ["limits", "requests"]) {
      if (x.resources?.[part]?.["nvidia.com/gpu"] !== undefined) {
        errors.push(`${ctx}: container ${x.name} resources.${part} has nvidia.com/gpu: the device ` +
                    `plugin's GPU is not the claimed one kvdepot sees`);
      }
    }
  }
  for (const name of mine) {
    const rc = (spec.resourceClaims ?? []).find((x) => x.name === name);
    const t = docs.find((d) => d.kind === "ResourceClaimTemplate" &&
                               d.metadata.name === rc?.resourceClaimTemplateName);
    const reqs = t?.spec?.spec?.devices?.requests ?? [];
    const ok = reqs.length === 1 && reqs[0].exactly?.deviceClassName === GPU_DEVICE_CLASS &&
        (reqs[0].exactly.allocationMode ?? "ExactCount") === "ExactCount" &&
        (reqs[0].exactly.count ?? 1) === 1;
    if (!ok) {
      errors.push(`${ctx}: claim ${name} must come from a ResourceClaimTemplate requesting exactly ` +
                  `1 device of class ${GPU_DEVICE_CLASS}`);
    }
  }
  const cfg = mountOf(c, "/etc/kvdepot");
  const cfgVol = cfg && (spec.volumes ?? []).find((v) => v.name === cfg.name);
  const cm = docs.find((d) => d.kind === "ConfigMap" && d.metadata.name === cfgVol?.configMap?.name);
  const pools = [...(cm?.data?.["kvdepotd.textproto"] ?? "").matchAll(/^\s*pools\s*\{(.*)\}\s*$/gm)];
  if (pools.length === 0) errors.push(`${ctx}: kvdepot's config has no pools`);
  pools.forEach((p, i) => {
    if (!/\bdevice:\s*"cuda:[0-9]+"/.test(p[1])) {
      errors.push(`${ctx}: kvdepot config pools[${i}] is not on a GPU (device: "cuda:N")`);
    }
  });
}

function checkHostPath(ctx, v, overlay, errors) {
  if (overlay === "daemonset" && v.name === "kvdepot-socket" &&
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
      if (isKvdepot(c)) {
        daemons++;
        checkKvdepot(ctx, w, c, inits.includes(c), overlay, docs, errors);
      } else if (c.name === "worker") {
        workers++;
        if (!mountOf(c, SOCKET_DIR)) errors.push(`${ctx}: worker does not mount ${SOCKET_DIR}`);
        const groups = podSc.supplementalGroups ?? [];
        const gid = c.securityContext?.runAsGroup ?? podSc.runAsGroup;
        if (gid !== KVDEPOT_UID && !groups.includes(KVDEPOT_UID)) {
          errors.push(`${ctx}: worker is not in group ${KVDEPOT_UID} (supplementalGroups)`);
        }
      }
    }
  }
  if (daemons === 0) errors.push("no kvdepot container in any pod template");
  if (workers === 0) errors.push("no worker container in any pod template");
  if (overlay === "daemonset") {
    if (!workloads.some((w) => w.kind === "DaemonSet" &&
                       w.spec.template.spec.containers.some(isKvdepot))) {
      errors.push("daemonset: kvdepot is not a DaemonSet");
    }
    if (!docs.some((d) => d.kind === "ServiceMonitor")) errors.push("daemonset: no ServiceMonitor");
  }
  return errors;
}
