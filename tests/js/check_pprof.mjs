// Independent check of the profiler's pprof output with a third-party decoder (pprof-format).
// Usage: node check_pprof.mjs <file.pb.gz | file.pb>
// Prints a JSON summary on stdout; exits 1 with a message on stderr when the profile is invalid.
import { readFileSync } from 'node:fs';
import { gunzipSync } from 'node:zlib';
import { Profile } from 'pprof-format';

function fail(message) {
  process.stderr.write(`invalid pprof: ${message}\n`);
  process.exit(1);
}

// The decoder yields number or bigint depending on magnitude; JSON needs plain numbers.
function toJsonNumber(value) {
  const big = BigInt(value);
  if (big > BigInt(Number.MAX_SAFE_INTEGER) || big < BigInt(Number.MIN_SAFE_INTEGER)) {
    return big.toString();
  }
  return Number(big);
}

const path = process.argv[2];
if (!path) fail('usage: node check_pprof.mjs <pprof file>');

let bytes = readFileSync(path);
if (bytes.length >= 2 && bytes[0] === 0x1f && bytes[1] === 0x8b) bytes = gunzipSync(bytes);

const profile = Profile.decode(bytes);
const strings = profile.stringTable.strings;

if (strings[0] !== '') fail(`stringTable[0] is ${JSON.stringify(strings[0])}, expected ""`);

function str(index, what) {
  const i = Number(index);
  if (!Number.isInteger(i) || i < 0 || i >= strings.length) {
    fail(`${what}: string index ${index} out of range (table has ${strings.length})`);
  }
  return strings[i];
}

function indexById(items, kind) {
  const byId = new Map();
  for (const item of items) {
    const id = BigInt(item.id);
    if (id === 0n) fail(`${kind} with id 0`);
    if (byId.has(id)) fail(`duplicate ${kind} id ${id}`);
    byId.set(id, item);
  }
  return byId;
}

const mappings = indexById(profile.mapping, 'mapping');
const functions = indexById(profile.function, 'function');
const locations = indexById(profile.location, 'location');

for (const m of profile.mapping) {
  str(m.filename, `mapping ${m.id} filename`);
  str(m.buildId, `mapping ${m.id} build_id`);
}
for (const f of profile.function) {
  str(f.name, `function ${f.id} name`);
  str(f.systemName, `function ${f.id} system_name`);
  str(f.filename, `function ${f.id} filename`);
}
for (const loc of profile.location) {
  const mappingId = BigInt(loc.mappingId);
  if (mappingId !== 0n && !mappings.has(mappingId)) {
    fail(`location ${loc.id} refers to missing mapping ${mappingId}`);
  }
  for (const line of loc.line) {
    if (!functions.has(BigInt(line.functionId))) {
      fail(`location ${loc.id} refers to missing function ${line.functionId}`);
    }
  }
}

const sampleTypes = profile.sampleType.map(
  (vt) => `${str(vt.type, 'sample_type.type')}/${str(vt.unit, 'sample_type.unit')}`,
);
const totals = sampleTypes.map(() => 0n);
const samples = [];
for (const [sampleIndex, sample] of profile.sample.entries()) {
  if (sample.value.length !== sampleTypes.length) {
    fail(`sample ${sampleIndex} has ${sample.value.length} values for ${sampleTypes.length} sample types`);
  }
  sample.value.forEach((v, i) => {
    totals[i] += BigInt(v);
  });
  // Leaf first: a location's lines are innermost first too, so flattening keeps the order.
  const functionNames = [];
  // The same frames with where they are: source file and line, address, object file.
  const frames = [];
  for (const locationId of sample.locationId) {
    const loc = locations.get(BigInt(locationId));
    if (!loc) fail(`sample ${sampleIndex} refers to missing location ${locationId}`);
    const mapping = mappings.get(BigInt(loc.mappingId));
    for (const line of loc.line) {
      const fn = functions.get(BigInt(line.functionId));
      functionNames.push(str(fn.name, 'function name'));
      frames.push({
        function: str(fn.name, 'function name'),
        file: str(fn.filename, 'function filename'),
        line: toJsonNumber(line.line),
        address: toJsonNumber(loc.address),
        object: mapping ? str(mapping.filename, 'mapping filename') : '',
        inlined: loc.line.length > 1,
      });
    }
  }
  const labels = {};
  for (const label of sample.label) {
    const key = str(label.key, 'label key');
    labels[key] = BigInt(label.str) !== 0n ? str(label.str, 'label str') : toJsonNumber(label.num);
  }
  samples.push({ functions: functionNames, frames, values: sample.value.map(toJsonNumber), labels });
}

const summary = {
  sampleTypes,
  periodType: profile.periodType
    ? `${str(profile.periodType.type, 'period_type.type')}/${str(profile.periodType.unit, 'period_type.unit')}`
    : null,
  period: toJsonNumber(profile.period),
  timeNanos: toJsonNumber(profile.timeNanos),
  durationNanos: toJsonNumber(profile.durationNanos),
  defaultSampleType: str(profile.defaultSampleType, 'default_sample_type'),
  comments: profile.comment.map((c) => str(c, 'comment')),
  totals: totals.map(toJsonNumber),
  mappings: profile.mapping.map((m) => ({
    filename: str(m.filename, 'mapping filename'),
    buildId: str(m.buildId, 'mapping build_id'),
    memoryStart: toJsonNumber(m.memoryStart),
    memoryLimit: toJsonNumber(m.memoryLimit),
    hasFunctions: m.hasFunctions,
    hasLineNumbers: m.hasLineNumbers,
  })),
  samples,
};
process.stdout.write(`${JSON.stringify(summary)}\n`);
