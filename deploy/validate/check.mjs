// Offline checks of a rendered kustomize overlay (the output of
// `kubectl kustomize deploy/k8s/overlays/NAME`), no cluster needed:
//
//   node check.mjs schema  OVERLAY RENDERED.yaml  every object against the
//       Kubernetes OpenAPI schemas (kubernetes-models) and the
//       prometheus-operator CRDs, plus the references between objects
//       (volumes, ConfigMaps, Service and ServiceMonitor selectors);
//   node check.mjs policy  OVERLAY RENDERED.yaml  the restricted Pod Security
//       Standard on every pod template, the kvdepot probes, drain timing,
//       metrics and socket wiring;
//   node check.mjs selftest OVERLAY RENDERED.yaml  breaks the rendered objects
//       one way at a time and expects each check to name the breakage.
//   node check.mjs probe-argv OVERLAY RENDERED.yaml  prints the kvdepot
//       probe's argv, one element per line (for the live probe test);
//   node check.mjs daemon-args OVERLAY RENDERED.yaml  prints the kvdepot
//       container's args, one per line (ditto).
//
// Exit 0 when everything holds; 1 with one line per problem otherwise.
import { readFileSync } from "node:fs";

import { WORKLOAD_KINDS, allContainers, isKvdepot, loadDocs } from "./common.mjs";
import { checkPolicy } from "./policy.mjs";
import { checkSchema } from "./schema.mjs";
import { selftest } from "./selftest.mjs";

export function daemonArgs(docs) {
  for (const w of docs.filter((d) => WORKLOAD_KINDS.has(d.kind))) {
    const c = allContainers(w.spec.template.spec).find(isKvdepot);
    if (c) return c.args ?? [];
  }
  return null;
}

export function probeArgv(docs) {
  for (const w of docs.filter((d) => WORKLOAD_KINDS.has(d.kind))) {
    const c = allContainers(w.spec.template.spec).find(isKvdepot);
    if (c?.readinessProbe?.exec?.command) return c.readinessProbe.exec.command;
  }
  return null;
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
    if (list === null) errors = [`no kvdepot ${mode}`];
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
