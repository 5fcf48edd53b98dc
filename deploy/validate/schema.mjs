// Schema and reference checks of rendered objects: every object against the
// Kubernetes OpenAPI schemas (kubernetes-models) or the prometheus-operator
// CRDs, with no field the API does not have, and the references between
// objects that no schema sees.
import { WORKLOAD_KINDS, allContainers, where } from "./common.mjs";
import { unknownFields } from "./fields.mjs";

function moduleFor(apiVersion, kind) {
  if (apiVersion === "monitoring.coreos.com/v1") {
    return `@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/${kind}`;
  }
  if (/^[a-z0-9.]*\/?v[0-9a-z]+$/.test(apiVersion)) return `kubernetes-models/${apiVersion}/${kind}`;
  return null;
}

async function modelFor(apiVersion, kind) {
  const mod = moduleFor(apiVersion, kind);
  if (mod === null) return null;
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
    errors.push(...unknownFields(obj, moduleFor(obj.apiVersion, obj.kind), where(obj)));
  }
  errors.push(...checkReferences(docs));
  return errors;
}

function labelsMatch(selector, labels) {
  const want = Object.entries(selector ?? {});
  return want.length > 0 && want.every(([k, v]) => labels?.[k] === v);
}

// Dynamic Resource Allocation: the pod's spec.resourceClaims (unique names,
// each from exactly one source, a template the overlay contains) and every
// container's resources.claims[].name naming one of them.
function checkClaimReferences(w, templates) {
  const errors = [];
  const spec = w.spec.template.spec;
  const claims = new Set();
  (spec.resourceClaims ?? []).forEach((rc, i) => {
    const at = `${where(w)}: spec.resourceClaims[${i}]`;
    if (claims.has(rc.name)) errors.push(`${at}: name ${rc.name} is not unique`);
    claims.add(rc.name);
    const sources = ["resourceClaimName", "resourceClaimTemplateName"].filter((k) => rc[k] !== undefined);
    if (sources.length !== 1) {
      errors.push(`${at}: needs exactly one of resourceClaimName, resourceClaimTemplateName; ` +
                  `has ${sources.length}`);
    }
    const t = rc.resourceClaimTemplateName;
    if (t !== undefined && !templates.has(t)) {
      errors.push(`${at}: names ResourceClaimTemplate ${t}, which the overlay does not contain`);
    }
  });
  for (const c of [...(spec.initContainers ?? []), ...spec.containers]) {
    (c.resources?.claims ?? []).forEach((cl, i) => {
      if (!claims.has(cl.name)) {
        errors.push(`${where(w)}: container ${c.name} resources.claims[${i}].name ${cl.name} ` +
                    `is not in spec.resourceClaims`);
      }
    });
  }
  return errors;
}

// References between objects that the schemas cannot see.
export function checkReferences(docs) {
  const errors = [];
  const configMaps = new Set(
    docs.filter((d) => d.kind === "ConfigMap").map((d) => d.metadata.name));
  const templates = new Set(
    docs.filter((d) => d.kind === "ResourceClaimTemplate").map((d) => d.metadata.name));
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
    errors.push(...checkClaimReferences(w, templates));
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
