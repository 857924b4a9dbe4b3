// The chart's values.schema.json (what Helm checks at install and upgrade) against values:
// the chart's own files must pass, a typo or a bad enum must be refused with its path.
//   node values_schema.mjs --schema S --values values.yaml [--values more.yaml] [--set a.b=v]
//                          [--expect-invalid "text in the error"]
import fs from 'node:fs';
import yaml from 'js-yaml';
import Ajv from 'ajv';

const args = process.argv.slice(2);
const all = (name) => args.flatMap((a, i) => (a === `--${name}` ? [args[i + 1]] : []));
const one = (name) => all(name)[0];

function merge(dst, src) {
  for (const [k, v] of Object.entries(src || {})) {
    if (v && typeof v === 'object' && !Array.isArray(v) && dst[k] && typeof dst[k] === 'object') {
      merge(dst[k], v);
    } else {
      dst[k] = v;
    }
  }
  return dst;
}
const values = {};
for (const f of all('values')) merge(values, yaml.load(fs.readFileSync(f, 'utf8')));
for (const s of all('set')) {  // a.b.c=value, the value read as YAML (numbers, booleans)
  const [path, text] = [s.slice(0, s.indexOf('=')), s.slice(s.indexOf('=') + 1)];
  const keys = path.split('.');
  let node = values;
  for (const k of keys.slice(0, -1)) node = node[k] = node[k] || {};
  node[keys[keys.length - 1]] = yaml.load(text);
}
const ajv = new Ajv({ allErrors: true, strict: false });
const validate = ajv.compile(JSON.parse(fs.readFileSync(one('schema'), 'utf8')));
const ok = validate(values);
const errors = (validate.errors || []).map((e) =>
  `${e.instancePath || '/'} ${e.message}${e.params?.additionalProperty ? ` (${e.params.additionalProperty})` : ''}${e.params?.allowedValues ? ` (${e.params.allowedValues.join(', ')})` : ''}`);
const expected = one('expect-invalid');
if (expected === undefined) {
  if (!ok) {
    for (const e of errors) console.error(`FAIL: ${e}`);
    process.exit(1);
  }
  console.log(`values valid: ${all('values').join(' + ')}${all('set').map((s) => ` --set ${s}`).join('')}`);
} else {
  if (ok || !errors.some((e) => e.includes(expected))) {
    console.error(`FAIL: wanted an error with "${expected}", got: ${ok ? 'valid' : errors.join('; ')}`);
    process.exit(1);
  }
  console.log(`refused${all('set').map((s) => ` --set ${s}`).join('')}: ${errors.find((e) => e.includes(expected))}`);
}
