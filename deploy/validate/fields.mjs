// Unknown-field check. The kubernetes-models validators accept fields the
// API does not have (a misspelt `readOnlyRootFileSystem` would pass and be
// dropped by the API server), so this walks each object along the
// TypeScript declarations shipped next to the models (one interface per
// API type, one file per interface, fields written `"name"?: Type;`, maps
// as `"name"?: {` / `[key: string]: Type;` / `};`) and
// reports every key that the type does not declare.
import { readFileSync } from "node:fs";
import { dirname, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const cache = new Map();

function resolveDts(specifier, fromFile) {
  let js;
  if (specifier.startsWith(".")) {
    js = resolve(dirname(fromFile), specifier);
  } else {
    js = fileURLToPath(import.meta.resolve(specifier));
  }
  return js.replace(/\.js$/, "") + ".d.ts";
}

// The interface declared in `file`: { name, fields: Map(field -> type
// text), imports: Map(identifier -> .d.ts path) }, or null for a type alias
// (IntOrString, Quantity...), which is a leaf.
function parse(file) {
  if (cache.has(file)) return cache.get(file);
  const text = readFileSync(file, "utf8");
  const imports = new Map();
  for (const m of text.matchAll(/^import \{ ([^}]+) \} from "([^"]+)";$/gm)) {
    for (const id of m[1].split(",").map((s) => s.trim())) imports.set(id, resolveDts(m[2], file));
  }
  const body = /^export interface (\w+)(?: extends [\w, ]+)? \{\n([\s\S]*?)^\}/m.exec(text);
  let result = null;
  if (body) {
    // A field starts at 4 spaces; a map type continues on deeper lines.
    const fields = new Map();
    let last = null;
    for (const line of body[2].split("\n")) {
      const f = /^ {4}"([^"]+)"\??: (.*)$/.exec(line);
      if (f) {
        last = f[1];
        fields.set(last, f[2]);
      } else if (last !== null && /^ {5,}\S/.test(line) && !/^ +(\/\*\*|\*)/.test(line)) {
        fields.set(last, `${fields.get(last)} ${line.trim()}`);
      } else {
        last = null;
      }
    }
    result = { name: body[1], fields, imports };
  }
  cache.set(file, result);
  return result;
}

function walk(value, file, at, errors) {
  if (value === null || typeof value !== "object" || Array.isArray(value)) return;
  const type = parse(file);
  if (type === null) return;
  for (const [key, child] of Object.entries(value)) {
    const text = type.fields.get(key);
    if (text === undefined) {
      errors.push(`${at}.${key} is not a field of ${type.name.replace(/^I/, "")}`);
      continue;
    }
    const ref = [...text.matchAll(/\b(I\w+)\b/g)].map((m) => m[1]).find((id) => type.imports.has(id));
    if (!ref) continue;
    const childFile = type.imports.get(ref);
    if (text.startsWith("Array<")) {
      (child ?? []).forEach((item, i) => walk(item, childFile, `${at}.${key}[${i}]`, errors));
    } else if (/^\{ \[key: string\]/.test(text)) {
      for (const [k, v] of Object.entries(child ?? {})) walk(v, childFile, `${at}.${key}.${k}`, errors);
    } else {
      walk(child, childFile, `${at}.${key}`, errors);
    }
  }
}

// `module` is the model's import specifier, e.g. "kubernetes-models/v1/Pod".
export function unknownFields(obj, module, where) {
  const errors = [];
  walk(obj, fileURLToPath(import.meta.resolve(module)).replace(/\.js$/, "") + ".d.ts", where, errors);
  return errors;
}
