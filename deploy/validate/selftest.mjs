// Mutation self-test: breaks the rendered objects one way at a time and
// expects the schema or policy check to report each breakage, so that a
// check that can no longer fail does not go unnoticed.
import { WORKLOAD_KINDS, allContainers, isKvdepot, loadDocs, mountOf } from "./common.mjs";
import { checkPolicy } from "./policy.mjs";
import { checkSchema } from "./schema.mjs";

function kvdepotOf(docs) {
  for (const w of docs.filter((d) => WORKLOAD_KINDS.has(d.kind))) {
    const c = allContainers(w.spec.template.spec).find(isKvdepot);
    if (c) return { w, c };
  }
  throw new Error("no kvdepot container");
}

function workerOf(docs) {
  for (const w of docs.filter((d) => WORKLOAD_KINDS.has(d.kind))) {
    const c = w.spec.template.spec.containers.find((x) => x.name === "worker");
    if (c) return { w, c };
  }
  throw new Error("no worker container");
}

function templateOf(docs) {
  const t = docs.find((d) => d.kind === "ResourceClaimTemplate");
  if (!t) throw new Error("no ResourceClaimTemplate");
  return t;
}

// Each mutation breaks one rule; the check must report it by `want`.
const MUTATIONS = [
  ["schema", "image must be string", (d) => { kvdepotOf(d).c.image = 7; }],
  ["schema", "must be integer", (d) => { kvdepotOf(d).w.spec.template.spec.terminationGracePeriodSeconds = "45"; }],
  ["schema", "which the overlay does not contain", (d) => {
    const cm = d.find((x) => x.kind === "ConfigMap");
    cm.metadata.name += "-stale";
  }],
  ["schema", "readOnlyRootFileSystem is not a field of SecurityContext", (d) => {
    kvdepotOf(d).c.securityContext.readOnlyRootFileSystem = true;
  }],
  ["schema", "sizeLimitt is not a field of EmptyDirVolumeSource", (d) => {
    const { w, c } = kvdepotOf(d);
    const name = mountOf(c, "/dev/shm").name;
    w.spec.template.spec.volumes.find((v) => v.name === name).emptyDir.sizeLimitt = "1Gi";
  }],
  ["schema", "restartPolicyy is not a field of Container", (d) => { workerOf(d).c.restartPolicyy = "Always"; }],
  ["schema", "mounts unknown volume", (d) => { kvdepotOf(d).c.volumeMounts[0].name = "nope"; }],
  ["schema", "selector does not match", (d) => { kvdepotOf(d).w.spec.template.metadata.labels = { a: "b" }; }],
  ["policy", "allowPrivilegeEscalation must be false", (d) => {
    delete workerOf(d).c.securityContext.allowPrivilegeEscalation;
  }],
  ["policy", "capabilities.drop must include ALL", (d) => { kvdepotOf(d).c.securityContext.capabilities.drop = ["NET_RAW"]; }],
  ["policy", "readOnlyRootFilesystem must be true", (d) => { kvdepotOf(d).c.securityContext.readOnlyRootFilesystem = false; }],
  ["policy", "runAsNonRoot must be true", (d) => { delete workerOf(d).w.spec.template.spec.securityContext.runAsNonRoot; }],
  ["policy", "seccompProfile.type must be RuntimeDefault", (d) => {
    kvdepotOf(d).c.securityContext.seccompProfile = { type: "Unconfined" };
  }],
  ["policy", "hostPID", (d) => { workerOf(d).w.spec.template.spec.hostPID = true; }],
  ["policy", "hostPath is not allowed", (d) => {
    workerOf(d).w.spec.template.spec.volumes.push({ name: "h", hostPath: { path: "/var" } });
  }],
  ["policy", "readinessProbe.exec.command is", (d) => { kvdepotOf(d).c.readinessProbe.exec.command[1] = "ping"; }],
  ["policy", "no livenessProbe", (d) => { delete kvdepotOf(d).c.livenessProbe; }],
  ["policy", "startupProbe.timeoutSeconds 5 does not exceed", (d) => { kvdepotOf(d).c.startupProbe.timeoutSeconds = 5; }],
  ["policy", "terminationGracePeriodSeconds 30 is shorter than the drain", (d) => {
    kvdepotOf(d).w.spec.template.spec.terminationGracePeriodSeconds = 30;
  }],
  ["policy", "= 96 s", (d) => {
    const { c } = kvdepotOf(d);
    c.args = c.args.map((a) => (a.startsWith("--drain_timeout_s=") ? "--drain_timeout_s=90" : a));
  }],
  ["policy", "/dev/shm must be a memory-backed emptyDir", (d) => {
    const { w, c } = kvdepotOf(d);
    const name = mountOf(c, "/dev/shm").name;
    w.spec.template.spec.volumes.find((v) => v.name === name).emptyDir = {};
  }],
  ["policy", "--metrics_address=0.0.0.0:9400 missing", (d) => {
    const { c } = kvdepotOf(d);
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
  ["policy", "initContainers entry with restartPolicy: Always", (d) => { delete kvdepotOf(d).c.restartPolicy; }],
  ["policy", "does not share /dev/shm with kvdepot", (d) => {
    const { c } = workerOf(d);
    c.volumeMounts = c.volumeMounts.filter((m) => m.mountPath !== "/dev/shm");
  }],
  // The shared GPU (DRA): types and field names of the new objects and
  // fields, the references between them, and the sharing rules.
  ["schema", "deviceClassName must be string", (d) => {
    templateOf(d).spec.spec.devices.requests[0].exactly.deviceClassName = 7;
  }],
  ["schema", "deviceClass is not a field of ExactDeviceRequest", (d) => {
    templateOf(d).spec.spec.devices.requests[0].exactly.deviceClass = "gpu.nvidia.com";
  }],
  ["schema", "resourceClaimTemplate is not a field of PodResourceClaim", (d) => {
    const rc = workerOf(d).w.spec.template.spec.resourceClaims[0];
    rc.resourceClaimTemplate = rc.resourceClaimTemplateName;
    delete rc.resourceClaimTemplateName;
  }],
  ["schema", "name must be string", (d) => { kvdepotOf(d).c.resources.claims[0].name = 1; }],
  ["schema", "needs exactly one of resourceClaimName, resourceClaimTemplateName; has 2", (d) => {
    workerOf(d).w.spec.template.spec.resourceClaims[0].resourceClaimName = "gpu-0";
  }],
  ["schema", "is not unique", (d) => {
    const rcs = workerOf(d).w.spec.template.spec.resourceClaims;
    rcs.push({ ...rcs[0] });
  }],
  ["schema", "names ResourceClaimTemplate kvdepot-gpu, which the overlay does not contain", (d) => {
    d.splice(d.findIndex((x) => x.kind === "ResourceClaimTemplate"), 1);
  }],
  ["schema", "container worker resources.claims[0].name gpuu is not in spec.resourceClaims", (d) => {
    workerOf(d).c.resources.claims[0].name = "gpuu";
  }],
  ["policy", "--backend=cpu; the sidecar shares the pod's GPU", (d) => {
    const { c } = kvdepotOf(d);
    c.args = c.args.map((a) => (a.startsWith("--backend=") ? "--backend=cpu" : a));
  }],
  ["policy", "--legacy_cuda_ipc shares GPU memory by bearer tokens", (d) => {
    const { c } = kvdepotOf(d);
    c.args = [...c.args, "--legacy_cuda_ipc"];
  }],
  ["policy", "--socket_group=65532 missing", (d) => {
    const { c } = kvdepotOf(d);
    c.args = c.args.filter((a) => !a.startsWith("--socket_group"));
  }],
  ["policy", "kvdepot has no GPU claim", (d) => { delete kvdepotOf(d).c.resources.claims; }],
  ["policy", "container worker does not share GPU claim gpu with kvdepot", (d) => {
    delete workerOf(d).c.resources.claims;
  }],
  ["policy", "container worker resources.limits has nvidia.com/gpu", (d) => {
    workerOf(d).c.resources.limits["nvidia.com/gpu"] = 1;
  }],
  ["policy", "container kvdepot resources.requests has nvidia.com/gpu", (d) => {
    kvdepotOf(d).c.resources.requests["nvidia.com/gpu"] = 1;
  }],
  ["policy", "requesting exactly 1 device of class gpu.nvidia.com", (d) => {
    templateOf(d).spec.spec.devices.requests[0].exactly.count = 2;
  }],
  ["policy", "requesting exactly 1 device of class gpu.nvidia.com", (d) => {
    templateOf(d).spec.spec.devices.requests[0].exactly.deviceClassName = "gpu.example.com";
  }],
  ["policy", "config pools[1] is not on a GPU", (d) => {
    const cm = d.find((x) => x.kind === "ConfigMap");
    const lines = cm.data["kvdepotd.textproto"].split("\n");
    const i = lines.map((l) => /^pools/.test(l)).lastIndexOf(true);
    lines[i] = lines[i].replace(/device: "[^"]*" /, "");
    cm.data["kvdepotd.textproto"] = lines.join("\n");
  }],
];
const DAEMONSET_MUTATIONS = [
  ["schema", "intervall is not a field of Endpoint", (d) => {
    d.find((x) => x.kind === "ServiceMonitor").spec.endpoints[0].intervall = "15s";
  }],
  ["schema", "endpoint port metrix", (d) => { d.find((x) => x.kind === "ServiceMonitor").spec.endpoints[0].port = "metrix"; }],
  ["schema", "selector matches no pod template", (d) => { d.find((x) => x.kind === "Service").spec.selector = { a: "b" }; }],
  ["policy", "hostPath is not allowed", (d) => {
    const { w } = kvdepotOf(d);
    w.spec.template.spec.volumes.find((v) => v.hostPath).hostPath.type = "DirectoryOrCreate";
  }],
  ["policy", "no ServiceMonitor", (d) => { d.splice(d.findIndex((x) => x.kind === "ServiceMonitor"), 1); }],
];

export async function selftest(text, overlay) {
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
