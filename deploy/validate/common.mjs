// Shared by the deploy/validate checks: the constants the manifests must
// agree with, YAML loading, and small accessors of pod specs.
import yaml from "js-yaml";

// The probe command every kvdepot container must run (/tmp/iface.md,
// docs/DEPLOY.md): exit 0 only while the daemon's health is SERVING.
export const SOCKET_DIR = "/run/kvdepot";
export const PROBE_ARGV = [
  "kvcachectl", "status", "--addr", `unix:${SOCKET_DIR}/daemon/kvdepotd.sock`,
];
export const KVDEPOT_UID = 65532; // deploy/docker/Dockerfile
export const METRICS_PORT = 9400;
// NVIDIA's DRA driver's DeviceClass (overlays/sidecar/gpu-claim-template.yaml).
export const GPU_DEVICE_CLASS = "gpu.nvidia.com";
export const DRAIN_TIMEOUT_DEFAULT_S = 30; // kvdepotd --drain_timeout_s
export const DRAIN_GRACE_DEFAULT_MS = 200; // kvdepotd --drain_grace_ms
export const DRAIN_MARGIN_S = 5;           // SIGKILL comes no sooner than this after
export const CTL_TIMEOUT_S = 5;            // kvcachectl --timeout default
// Volume types the restricted Pod Security Standard allows.
export const RESTRICTED_VOLUMES = new Set([
  "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
  "persistentVolumeClaim", "projected", "secret",
]);
export const WORKLOAD_KINDS = new Set([
  "Deployment", "DaemonSet", "StatefulSet", "Job", "ReplicaSet",
]);

export function loadDocs(text) {
  return yaml.loadAll(text).filter((d) => d !== null && d !== undefined);
}

export function where(obj) {
  return `${obj.kind}/${obj.metadata?.name ?? "?"}`;
}

export function allContainers(spec) {
  return [...(spec.initContainers ?? []), ...(spec.containers ?? [])];
}

export function isKvdepot(c) {
  return c.name === "kvdepot";
}

export function flagValue(args, name) {
  const prefix = `--${name}=`;
  const a = (args ?? []).find((x) => x.startsWith(prefix));
  return a === undefined ? undefined : a.slice(prefix.length);
}

export function sameArgv(a, b) {
  return Array.isArray(a) && a.length === b.length && a.every((x, i) => x === b[i]);
}

export function mountOf(c, path) {
  return (c.volumeMounts ?? []).find((m) => m.mountPath === path);
}
