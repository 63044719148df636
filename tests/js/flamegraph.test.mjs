// Unit tests of the web UI's flame-graph data code (profiler-user/ui/flamegraph.mjs).
// Run: node --test tests/js/flamegraph.test.mjs (tests/tests/ui.rs runs it too).
import assert from 'node:assert/strict';
import { test } from 'node:test';

import {
  decodeDiff,
  describeChange,
  decodeFlamegraph,
  diffColor,
  findPath,
  formatPercent,
  formatValue,
  hitTest,
  layout,
  pathOf,
  relativeChange,
  rowCount,
  search,
  labelSelector,
  sandwich,
  serviceSelector,
  shareChange,
  sortRows,
  topFunctions,
  unitOf,
} from '../../profiler-user/ui/flamegraph.mjs';

/**
 * Encodes a tree `{name, self, children}` the way the server does (docs/pyroscope-protocol.md §7.4):
 * self left of the children, children in order, x delta-encoded per level, int64 as strings.
 */
function encode(tree) {
  const names = ['total'];
  const nameId = (name) => {
    let id = names.indexOf(name);
    if (id < 0) id = names.push(name) - 1;
    return id;
  };
  const totalOf = (node) => node.self + (node.children ?? []).reduce((s, c) => s + totalOf(c), 0);
  const levels = [];
  let maxSelf = 0;
  const walk = (node, depth, x) => {
    levels[depth] ??= [];
    const total = totalOf(node);
    levels[depth].push([x, total, node.self, depth === 0 ? 0 : nameId(node.name)]);
    maxSelf = Math.max(maxSelf, node.self);
    let next = x + node.self;
    for (const child of node.children ?? []) {
      walk(child, depth + 1, next);
      next += totalOf(child);
    }
  };
  walk(tree, 0, 0);
  return {
    names,
    levels: levels.map((level) => {
      let end = 0;
      const values = [];
      for (const [x, total, self, name] of level) {
        values.push(String(x - end), String(total), String(self), String(name));
        end = x + total;
      }
      return { values };
    }),
    total: String(totalOf(tree)),
    maxSelf: String(maxSelf),
  };
}

/** The decoded tree back as `{name, self, total, children}` for comparison. */
function plain(node) {
  return {
    name: node.name,
    self: node.self,
    total: node.total,
    children: node.children.map(plain),
  };
}

function withTotals(node) {
  const children = (node.children ?? []).map(withTotals);
  const total = node.self + children.reduce((s, c) => s + c.total, 0);
  return { name: node.name, self: node.self, total, children };
}

const sample = {
  name: 'total',
  self: 0,
  children: [
    { name: 'main', self: 1, children: [{ name: 'work', self: 5 }, { name: 'io', self: 2 }] },
    { name: 'other_thread', self: 4 },
  ],
};

test('decodes the server encoding (the Rust render test\'s levels)', () => {
  const tree = decodeFlamegraph({
    names: ['total', 'a', 'b', 'c'],
    levels: [{ values: [0, 10, 0, 0] }, { values: [0, 6, 1, 1, 0, 4, 4, 3] }, { values: [1, 5, 5, 2] }],
    total: '10',
    maxSelf: '5',
  });
  assert.equal(tree.total, 10);
  assert.equal(tree.maxSelf, 5);
  assert.deepEqual(plain(tree.root), {
    name: 'total',
    self: 0,
    total: 10,
    children: [
      { name: 'a', self: 1, total: 6, children: [{ name: 'b', self: 5, total: 5, children: [] }] },
      { name: 'c', self: 4, total: 4, children: [] },
    ],
  });
  const b = tree.nodes.find((n) => n.name === 'b');
  assert.equal(b.x, 1);
  assert.equal(b.depth, 2);
  assert.equal(b.parent.name, 'a');
});

test('encode then decode gives back random trees', () => {
  let seed = 42;
  const random = () => {
    seed = (seed * 1103515245 + 12345) % 2 ** 31;
    return seed / 2 ** 31;
  };
  const names = ['f', 'g', 'h', 'k', 'm'];
  const grow = (depth) => ({
    name: names[Math.floor(random() * names.length)],
    self: Math.floor(random() * 5) + (depth > 4 ? 1 : 0),
    children: depth > 5 ? [] : Array.from({ length: Math.floor(random() * 3) }, () => grow(depth + 1)),
  });
  for (let i = 0; i < 50; i++) {
    const tree = { name: 'total', self: 0, children: Array.from({ length: 3 }, () => grow(1)) };
    const expected = withTotals(tree);
    // Zero-total nodes are not drawn (the server never sends them).
    const prune = (n) => ({ ...n, children: n.children.filter((c) => c.total > 0).map(prune) });
    const decoded = decodeFlamegraph(encode(tree));
    assert.deepEqual(plain(decoded.root), prune(expected));
  }
});

test('nodes outside every parent and missing input are tolerated', () => {
  const tree = decodeFlamegraph({
    names: ['total', 'a', 'stray'],
    levels: [{ values: ['0', '5', '0', '0'] }, { values: ['0', '5', '5', '1', '3', '2', '2', '2'] }],
  });
  assert.deepEqual(
    tree.root.children.map((c) => c.name),
    ['a'],
  );
  const empty = decodeFlamegraph(undefined);
  assert.equal(empty.total, 0);
  assert.deepEqual(empty.root.children, []);
  assert.deepEqual(layout(empty, empty.root, 800), []);
});

test('diff: both sides kept, drawn side by side, change of share', () => {
  // total: left 10, right 14; a: 6 → 6 (b: 5 → 5), c: 4 → 8
  const tree = decodeDiff({
    names: ['total', 'a', 'b', 'c'],
    levels: [
      { values: ['0', '10', '0', '0', '14', '0', '0'] },
      { values: ['0', '6', '1', '0', '6', '1', '1', '0', '4', '4', '0', '8', '8', '3'] },
      { values: ['1', '5', '5', '1', '5', '5', '2'] },
    ],
    total: '24',
    leftTicks: '10',
    rightTicks: '14',
  });
  assert.equal(tree.diff, true);
  assert.equal(tree.total, 24);
  const [a, c] = tree.root.children;
  assert.equal(a.name, 'a');
  assert.equal(c.name, 'c');
  assert.deepEqual([c.left.total, c.right.total, c.total, c.x], [4, 8, 12, 12]);
  assert.equal(a.children[0].name, 'b');
  assert.equal(a.children[0].x, 2);
  // c: 40% of the baseline, 57% of the comparison.
  assert.ok(Math.abs(shareChange(c, 10, 14) - (8 / 14 - 0.4)) < 1e-12);
  assert.ok(shareChange(a, 10, 14) < 0);
  assert.ok(Math.abs(relativeChange(c, 10, 14) - (8 / 14 / 0.4 - 1)) < 1e-12);
  assert.equal(relativeChange({ left: { total: 0 }, right: { total: 3 } }, 10, 14), Infinity);
  assert.match(diffColor(0.1), /^hsl\(0,/);
  assert.match(diffColor(-0.1), /^hsl\(215,/);
  assert.equal(diffColor(0), 'hsl(0, 0%, 78%)');
  assert.notEqual(diffColor(0.05), diffColor(0.2));
  const rows = topFunctions(tree);
  const cRow = rows.find((r) => r.name === 'c');
  assert.deepEqual([cRow.leftSelf, cRow.rightSelf, cRow.leftTotal, cRow.rightTotal], [4, 8, 4, 8]);
});

test('search: substring and regex, covered value counts recursion once', () => {
  const tree = decodeFlamegraph(
    encode({
      name: 'total',
      self: 0,
      children: [
        { name: 'main', self: 0, children: [{ name: 'recurse', self: 1, children: [{ name: 'recurse', self: 3 }] }] },
        { name: 'idle', self: 6 },
      ],
    }),
  );
  const hit = search(tree, 'RECUR');
  assert.equal(hit.matched.size, 2);
  assert.equal(hit.value, 4);
  assert.equal(hit.percent, 40);
  const regex = search(tree, '/^(main|idle)$/');
  assert.equal(regex.value, 10);
  assert.equal(regex.percent, 100);
  assert.equal(search(tree, '').matched.size, 0);
  const bad = search(tree, '/(/');
  assert.equal(bad.matched.size, 0);
  assert.ok(bad.error);
  // Within a zoomed frame the percent is of that frame.
  const main = tree.root.children.find((n) => n.name === 'main');
  assert.equal(search(tree, 'recurse', main).percent, 100);
});

test('top functions: self summed, total once per stack, sortable', () => {
  const tree = decodeFlamegraph(
    encode({
      name: 'total',
      self: 0,
      children: [
        { name: 'a', self: 1, children: [{ name: 'a', self: 2, children: [{ name: 'b', self: 3 }] }] },
        { name: 'b', self: 4 },
      ],
    }),
  );
  const rows = topFunctions(tree);
  const byName = Object.fromEntries(rows.map((r) => [r.name, r]));
  assert.deepEqual([byName.a.self, byName.a.total], [3, 6]);
  assert.deepEqual([byName.b.self, byName.b.total], [7, 7]);
  assert.equal(byName.total, undefined);
  assert.deepEqual(sortRows(rows, 'self').map((r) => r.name), ['b', 'a']);
  assert.deepEqual(sortRows(rows, 'self', false).map((r) => r.name), ['a', 'b']);
  assert.deepEqual(sortRows(rows, 'name', false).map((r) => r.name), ['a', 'b']);
  assert.deepEqual(sortRows(rows, 'total').map((r) => r.name), ['b', 'a']);
});

test('layout: zoomed frame fills the width, ancestors above, tiny frames left out', () => {
  const tree = decodeFlamegraph(encode(sample));
  const full = layout(tree, tree.root, 1200);
  assert.equal(full.length, tree.nodes.length);
  const work = tree.nodes.find((n) => n.name === 'work');
  const workRect = full.find((r) => r.node === work);
  // main: x 0..8 of 12, self 1, so work starts at 1/12 of the width.
  assert.equal(workRect.x, 100);
  assert.equal(workRect.width, 500);
  assert.equal(rowCount(full), 3);

  const main = tree.nodes.find((n) => n.name === 'main');
  const zoomed = layout(tree, main, 800);
  const names = zoomed.map((r) => r.node.name);
  assert.deepEqual(names, ['total', 'main', 'work', 'io']);
  const mainRect = zoomed.find((r) => r.node === main);
  assert.deepEqual([mainRect.x, mainRect.width, mainRect.row], [0, 800, 1]);
  assert.deepEqual(zoomed[0], { node: tree.root, x: 0, width: 800, row: 0 });
  assert.equal(hitTest(zoomed, 150, 2).node.name, 'work');
  assert.equal(hitTest(zoomed, 799, 2).node.name, 'io');
  assert.equal(hitTest(zoomed, 800, 2), null);
  assert.equal(hitTest(zoomed, 50, 2), null); // main's own time, no child there

  // At 10 px wide, frames narrower than 2 px are not drawn.
  const narrow = layout(tree, tree.root, 10, 2);
  assert.ok(!narrow.some((r) => r.node.name === 'io'));
  assert.ok(narrow.some((r) => r.node.name === 'work'));
});

test('zoom survives a reload by path of names', () => {
  const tree = decodeFlamegraph(encode(sample));
  const io = tree.nodes.find((n) => n.name === 'io');
  assert.deepEqual(pathOf(io), ['main', 'io']);
  const reloaded = decodeFlamegraph(encode(sample));
  assert.equal(findPath(reloaded, ['main', 'io']).name, 'io');
  assert.equal(findPath(reloaded, ['main', 'gone']).name, 'main');
  assert.equal(findPath(reloaded, []), reloaded.root);
});

test('formatting and selectors', () => {
  assert.equal(unitOf('process_cpu:cpu:nanoseconds:cpu:nanoseconds'), 'nanoseconds');
  assert.equal(unitOf('process_cpu:samples:count:cpu:nanoseconds'), 'count');
  assert.equal(formatValue(1_500_000_000, 'nanoseconds'), '1.50 s');
  assert.equal(formatValue(90e9, 'nanoseconds'), '1.50 min');
  assert.equal(formatValue(2_500_000, 'nanoseconds'), '2.50 ms');
  assert.equal(formatValue(512, 'bytes'), '512 B');
  assert.equal(formatValue(3 * 2 ** 30, 'bytes'), '3.00 GiB');
  assert.equal(formatValue(999, 'count'), '999');
  assert.equal(formatValue(12_345, 'count'), '12.3 k');
  assert.equal(formatPercent(1, 4), '25.0%');
  assert.equal(formatPercent(1, 3), '33.3%');
  assert.equal(formatPercent(1, 300), '0.33%');
  assert.equal(formatPercent(1, 1e6), '<0.01%');
  assert.equal(formatPercent(1, 0), '0%');
  assert.equal(serviceSelector('api'), '{service_name="api"}');
  assert.equal(serviceSelector('a"b\\c'), '{service_name="a\\"b\\\\c"}');
  assert.equal(serviceSelector(''), '{}');
  assert.equal(
    labelSelector('api', [{ name: 'pod', value: 'web-1' }, { name: 'otel.scope.name', value: 'x"y' }]),
    '{service_name="api",pod="web-1",otel.scope.name="x\\"y"}',
  );
  // Not a label name, or the service's own label: left out rather than a refused selector.
  assert.equal(labelSelector('api', [{ name: 'a b', value: '1' }, { name: 'service_name', value: 'x' }]), '{service_name="api"}');
  assert.equal(labelSelector('', [{ name: 'pod', value: 'p' }]), '{pod="p"}');
});

test('a change that rounds to nothing reads 0.0%, never -0.0%', () => {
  assert.equal(describeChange(-0.0001), '0.0%');
  assert.equal(describeChange(0.0001), '0.0%');
  assert.equal(describeChange(0.123), '+12.3%');
  assert.equal(describeChange(-0.04), '-4.0%');
  assert.equal(describeChange(Infinity), 'new');
});

test('the sandwich of a function: its callers and its callees, recursion counted once', () => {
  // main → a → f → g (3), main → b → f → h (2), main → f (1, self), main → f → f → g (4).
  const tree = decodeFlamegraph({
    names: ['total', 'main', 'a', 'b', 'f', 'g', 'h'],
    levels: [
      { values: [0, 10, 0, 0] },
      { values: [0, 10, 0, 1] },
      { values: [0, 3, 0, 2, 0, 2, 0, 3, 0, 5, 1, 4] },
      { values: [0, 3, 0, 4, 0, 2, 0, 4, 0, 4, 0, 4] },
      { values: [0, 3, 3, 5, 0, 2, 2, 6, 0, 4, 4, 5] },
    ],
  });
  const { callers, callees } = sandwich(tree, 'f');
  assert.equal(callees.root.name, 'f');
  assert.equal(callees.total, 10);
  const calleeNames = new Map(callees.root.children.map((c) => [c.name, c.total]));
  assert.deepEqual(calleeNames, new Map([['g', 3], ['h', 2], ['f', 4]]));
  assert.equal(callers.total, 10);
  const callerNames = new Map(callers.root.children.map((c) => [c.name, c.total]));
  assert.deepEqual(callerNames, new Map([['main', 5], ['a', 3], ['b', 2]]));
  const viaA = callers.root.children.find((c) => c.name === 'a');
  assert.deepEqual(viaA.children.map((c) => [c.name, c.total]), [['main', 3]]);
  // Laid out left to right, parents before children, ready to draw.
  assert.ok(callers.nodes.every((n, i) => n.id === i && (n.parent === null || n.parent.id < i)));
  assert.equal(sandwich(tree, 'absent').callers.total, 0);
});
