// Flame-graph data: decoding the query API's FlameGraph / FlameGraphDiff levels into a tree,
// search, the top-functions table, layout and formatting. No DOM here, so `node --test` can
// check it (tests/js/flamegraph.test.mjs).

// Int64 fields arrive as strings in protobuf JSON; values stay far below 2^53.
const num = (value) => (value === undefined || value === null ? 0 : Number(value));

/**
 * A node of the decoded tree. `x` and `total` are in the drawing's value space: for a diff,
 * both sides side by side (left + right), so a node's width shows how much it weighs in both.
 */
function makeNode(id, name, depth, x, total, self) {
  return { id, name, depth, x, total, self, parent: null, children: [] };
}

/** Delta-encoded absolute x columns of one level, in place: `x_abs = delta + prev_end`. */
function absoluteLevel(values, width, columns) {
  const tuples = [];
  const ends = columns.map(() => 0);
  for (let i = 0; i + width <= values.length; i += width) {
    const tuple = values.slice(i, i + width).map(num);
    columns.forEach(([xCol, totalCol], k) => {
      tuple[xCol] += ends[k];
      ends[k] = tuple[xCol] + tuple[totalCol];
    });
    tuples.push(tuple);
  }
  return tuples;
}

/**
 * Links each level's nodes to the parent whose [x, x + total) holds them. Levels are sorted by
 * x, so one pointer per level suffices. Nodes no parent holds (malformed input) are dropped.
 */
function linkLevels(levels) {
  const nodes = [];
  let previous = [];
  levels.forEach((level, depth) => {
    const kept = [];
    let p = 0;
    for (const node of level) {
      if (depth === 0) {
        kept.push(node);
        continue;
      }
      while (p < previous.length && node.x >= previous[p].x + previous[p].total) p++;
      const parent = previous[p];
      if (!parent || node.x < parent.x || node.x + node.total > parent.x + parent.total) continue;
      node.parent = parent;
      parent.children.push(node);
      kept.push(node);
    }
    kept.forEach((node) => {
      node.id = nodes.length;
      nodes.push(node);
    });
    previous = kept;
  });
  return nodes;
}

/**
 * Decodes a FlameGraph (`{names, levels: [{values}], total, maxSelf}`, 4-tuples
 * `[x_delta, total, self, name]`) into `{root, nodes, total, maxSelf, diff: false}`.
 */
export function decodeFlamegraph(flamegraph) {
  const names = flamegraph?.names ?? [];
  const levels = (flamegraph?.levels ?? []).map((level, depth) =>
    absoluteLevel(level?.values ?? [], 4, [[0, 1]])
      .filter((t) => t[1] > 0 || depth === 0)
      .map(([x, total, self, name]) => makeNode(0, names[name] ?? '?', depth, x, total, self)),
  );
  const nodes = linkLevels(levels);
  const root = nodes[0] ?? makeNode(0, 'total', 0, 0, 0, 0);
  return { root, nodes, total: root.total, maxSelf: num(flamegraph?.maxSelf), diff: false };
}

/**
 * Decodes a FlameGraphDiff (7-tuples `[xl, totall, selfl, xr, totalr, selfr, name]`, both x
 * columns delta-encoded). Each node keeps `left` and `right` `{total, self}`; its drawing
 * coordinates are the sums of both sides.
 */
export function decodeDiff(flamegraph) {
  const names = flamegraph?.names ?? [];
  const levels = (flamegraph?.levels ?? []).map((level, depth) =>
    absoluteLevel(level?.values ?? [], 7, [
      [0, 1],
      [3, 4],
    ])
      .filter((t) => t[1] + t[4] > 0 || depth === 0)
      .map(([xl, tl, sl, xr, tr, sr, name]) => {
        const node = makeNode(0, names[name] ?? '?', depth, xl + xr, tl + tr, sl + sr);
        node.left = { total: tl, self: sl };
        node.right = { total: tr, self: sr };
        return node;
      }),
  );
  const nodes = linkLevels(levels);
  const root = nodes[0] ?? makeNode(0, 'total', 0, 0, 0, 0);
  if (!root.left) {
    root.left = { total: 0, self: 0 };
    root.right = { total: 0, self: 0 };
  }
  return {
    root,
    nodes,
    total: root.total,
    maxSelf: num(flamegraph?.maxSelf),
    diff: true,
    leftTicks: num(flamegraph?.leftTicks),
    rightTicks: num(flamegraph?.rightTicks),
  };
}

/**
 * How a diff node's share changed from the baseline (left) to the comparison (right), as a
 * fraction of each side's total: +0.1 means 10 points more of the comparison's time.
 */
export function shareChange(node, leftTicks, rightTicks) {
  const before = leftTicks > 0 ? node.left.total / leftTicks : 0;
  const after = rightTicks > 0 ? node.right.total / rightTicks : 0;
  return after - before;
}

/** Relative change of a diff node's share (`+1` = doubled), `Infinity` when it is new. */
export function relativeChange(node, leftTicks, rightTicks) {
  const before = leftTicks > 0 ? node.left.total / leftTicks : 0;
  const after = rightTicks > 0 ? node.right.total / rightTicks : 0;
  if (before === 0) return after === 0 ? 0 : Infinity;
  return after / before - 1;
}

/** The path of names from the root's child down to `node` (to find it again after a reload). */
export function pathOf(node) {
  const path = [];
  for (let n = node; n && n.parent; n = n.parent) path.push(n.name);
  return path.reverse();
}

/** The node at `path` (names below the root), or the deepest one that exists. */
export function findPath(tree, path) {
  let node = tree.root;
  for (const name of path ?? []) {
    const next = node.children.find((c) => c.name === name);
    if (!next) break;
    node = next;
  }
  return node;
}

/**
 * A search predicate: `/re/flags` is a regular expression, anything else a case-insensitive
 * substring. An invalid expression matches nothing (and says so in `error`).
 */
export function matcher(query) {
  const text = (query ?? '').trim();
  if (!text) return { test: () => false, empty: true, error: null };
  const regex = /^\/(.+)\/([a-z]*)$/.exec(text);
  if (regex) {
    try {
      const re = new RegExp(regex[1], regex[2].includes('i') ? 'i' : '');
      return { test: (name) => re.test(name), empty: false, error: null };
    } catch (err) {
      return { test: () => false, empty: false, error: String(err.message ?? err) };
    }
  }
  const needle = text.toLowerCase();
  return { test: (name) => name.toLowerCase().includes(needle), empty: false, error: null };
}

/**
 * Nodes whose name matches, and the value they cover: the sum of the totals of matching nodes
 * that have no matching ancestor (so recursion is not counted twice), under `within` (default:
 * the whole tree). `percent` is relative to `within`'s total.
 */
export function search(tree, query, within = tree.root) {
  const match = matcher(query);
  const matched = new Set();
  let value = 0;
  if (!match.empty) {
    const walk = (node, covered) => {
      const hit = node !== tree.root && match.test(node.name);
      if (hit) matched.add(node);
      if (hit && !covered) value += node.total;
      for (const child of node.children) walk(child, covered || hit);
    };
    walk(within, false);
  }
  const percent = within.total > 0 ? (100 * value) / within.total : 0;
  return { matched, value, percent, error: match.error };
}

/**
 * One row per function name: `self` summed over all its nodes, `total` summed over nodes that
 * have no ancestor of the same name (a recursive function counts once per stack). For diffs
 * the same per side (`leftSelf`, `rightSelf`, `leftTotal`, `rightTotal`).
 */
export function topFunctions(tree) {
  const rows = new Map();
  const row = (name) => {
    let r = rows.get(name);
    if (!r) {
      r = { name, self: 0, total: 0, leftSelf: 0, rightSelf: 0, leftTotal: 0, rightTotal: 0 };
      rows.set(name, r);
    }
    return r;
  };
  const open = new Map();
  const walk = (node) => {
    const r = row(node.name);
    r.self += node.self;
    if (tree.diff) {
      r.leftSelf += node.left.self;
      r.rightSelf += node.right.self;
    }
    const outermost = !open.get(node.name);
    if (outermost) {
      r.total += node.total;
      if (tree.diff) {
        r.leftTotal += node.left.total;
        r.rightTotal += node.right.total;
      }
    }
    open.set(node.name, (open.get(node.name) ?? 0) + 1);
    for (const child of node.children) walk(child);
    open.set(node.name, open.get(node.name) - 1);
  };
  for (const child of tree.root.children) walk(child);
  return [...rows.values()];
}

/**
 * Sorts table rows by `key` (`name` alphabetically, anything else numerically), `descending`
 * by default; ties by name so the order is stable.
 */
export function sortRows(rows, key, descending = true) {
  const sign = descending ? -1 : 1;
  return [...rows].sort((a, b) => {
    const primary =
      key === 'name' ? a.name.localeCompare(b.name) : (a[key] ?? 0) - (b[key] ?? 0);
    return primary !== 0 ? sign * primary : a.name.localeCompare(b.name);
  });
}

/**
 * Rectangles to draw for a view focused on `focus`, `width` pixels wide: the focused subtree
 * scaled to the full width, its ancestors as full-width bars above it. Nodes narrower than
 * `minWidth` pixels are left out (their parent still covers them). Each rectangle is
 * `{node, x, width, row}` with `row` the line it is drawn on (0 = top).
 */
export function layout(tree, focus, width, minWidth = 0.5) {
  const rects = [];
  if (!focus || focus.total <= 0 || width <= 0) return rects;
  const ancestors = [];
  for (let n = focus.parent; n; n = n.parent) ancestors.unshift(n);
  ancestors.forEach((node, row) => rects.push({ node, x: 0, width, row }));
  const scale = width / focus.total;
  const stack = [focus];
  while (stack.length) {
    const node = stack.pop();
    const w = node.total * scale;
    if (w < minWidth) continue;
    rects.push({ node, x: (node.x - focus.x) * scale, width: w, row: node.depth });
    for (let i = node.children.length - 1; i >= 0; i--) stack.push(node.children[i]);
  }
  return rects;
}

/** The deepest level in `rects` + 1: how many rows the drawing needs. */
export function rowCount(rects) {
  return rects.reduce((max, r) => Math.max(max, r.row + 1), 0);
}

/** Which rectangle is under (px, row), if any. */
export function hitTest(rects, px, row) {
  for (let i = rects.length - 1; i >= 0; i--) {
    const r = rects[i];
    if (r.row === row && px >= r.x && px < r.x + r.width) return r;
  }
  return null;
}

/** A profile type ID's value unit (`process_cpu:cpu:nanoseconds:cpu:nanoseconds` → nanoseconds). */
export function unitOf(profileTypeId) {
  return (profileTypeId ?? '').split(':')[2] ?? '';
}

function scaled(value, steps) {
  let abs = Math.abs(value);
  for (const [limit, divisor, suffix] of steps) {
    if (abs >= limit) {
      const v = value / divisor;
      const digits = Math.abs(v) >= 100 ? 0 : Math.abs(v) >= 10 ? 1 : 2;
      return `${v.toFixed(digits)} ${suffix}`.trim();
    }
  }
  return `${value}`;
}

/** A value in the profile type's unit, human-readable (`1.50 s`, `12.3 MiB`, `4.20 k`). */
export function formatValue(value, unit) {
  const v = Number(value) || 0;
  if (v === 0) return '0';
  switch (unit) {
    case 'nanoseconds':
      return scaled(v, [
        [3.6e12, 3.6e12, 'h'],
        [6e10, 6e10, 'min'],
        [1e9, 1e9, 's'],
        [1e6, 1e6, 'ms'],
        [1e3, 1e3, 'µs'],
        [0, 1, 'ns'],
      ]);
    case 'bytes':
      return scaled(v, [
        [2 ** 40, 2 ** 40, 'TiB'],
        [2 ** 30, 2 ** 30, 'GiB'],
        [2 ** 20, 2 ** 20, 'MiB'],
        [2 ** 10, 2 ** 10, 'KiB'],
        [0, 1, 'B'],
      ]);
    default: {
      const suffix = unit === 'count' || !unit ? '' : ` ${unit}`;
      if (Math.abs(v) < 1000) return `${v}${suffix}`;
      return (
        scaled(v, [
          [1e9, 1e9, 'G'],
          [1e6, 1e6, 'M'],
          [1e3, 1e3, 'k'],
        ]) + suffix
      );
    }
  }
}

/** `12.34%`, with fewer digits for large values and `<0.01%` for tiny non-zero ones. */
export function formatPercent(part, whole) {
  if (!whole) return '0%';
  const p = (100 * part) / whole;
  if (p !== 0 && Math.abs(p) < 0.01) return p > 0 ? '<0.01%' : '>-0.01%';
  return `${p.toFixed(Math.abs(p) >= 10 ? 1 : 2)}%`;
}

/** Stable colour per function name (warm palette, as flame graphs traditionally are). */
export function nameColor(name) {
  let hash = 2166136261;
  for (let i = 0; i < name.length; i++) {
    hash ^= name.charCodeAt(i);
    hash = Math.imul(hash, 16777619);
  }
  const h = 10 + ((hash >>> 0) % 40);
  const l = 55 + ((hash >>> 8) % 15);
  return `hsl(${h}, 80%, ${l}%)`;
}

/**
 * Diff colour: red where the comparison spends a larger share than the baseline, blue where
 * smaller, grey when unchanged; saturation grows with the change (full at ±`scale` of the
 * total, 20 points by default). Red against blue, not green: the two stay apart for the
 * red-green colour blind (deuteranopia, protanopia), and lightness differs as well.
 */
export function diffColor(change, scale = 0.2) {
  const strength = Math.min(1, Math.abs(change) / scale);
  if (strength < 0.01) return 'hsl(0, 0%, 78%)';
  const hue = change > 0 ? 0 : 215;
  return `hsl(${hue}, ${Math.round(30 + 60 * strength)}%, ${Math.round(80 - 30 * strength)}%)`;
}

/** The label selector of one service (`{service_name="api"}`), quotes and backslashes escaped. */
export function serviceSelector(service) {
  return labelSelector(service, []);
}

/** The label selector of a service narrowed by label filters (`[{name, value}]`, each an
 * equality matcher): `{service_name="api",pod="web-1"}`. Names that are not label names are
 * left out (the query API would refuse the whole selector). */
export function labelSelector(service, filters) {
  const quote = (value) => String(value).replace(/\\/g, '\\\\').replace(/"/g, '\\"');
  const matchers = [];
  if (service) matchers.push(`service_name="${quote(service)}"`);
  for (const { name, value } of filters) {
    if (/^[A-Za-z_][A-Za-z0-9_.]*$/.test(name) && name !== 'service_name') {
      matchers.push(`${name}="${quote(value)}"`);
    }
  }
  return `{${matchers.join(',')}}`;
}

/** A relative change as the tooltip shows it: `new`, `+12.3%`, `-4.0%`, and `0.0%` for what
 * rounds to nothing (never `-0.0%`). */
export function describeChange(change) {
  if (change === Infinity) return 'new';
  const percent = (100 * change).toFixed(1);
  if (Number(percent) === 0) return '0.0%';
  return `${change > 0 ? '+' : ''}${percent}%`;
}

/**
 * The sandwich view of function `name`: `callees`, a tree rooted at `name` merging everything it
 * calls wherever it runs, and `callers`, a tree rooted at `name` whose children are its direct
 * callers, their children the callers' callers, and so on to the outermost frame. Both roots'
 * totals are the function's total (each outermost occurrence counted once, so recursion is not
 * counted twice). Trees as `decodeFlamegraph` makes them, laid out left to right.
 */
export function sandwich(tree, name) {
  const occurrences = [];
  const visit = (node, inside) => {
    const here = node.name === name && node !== tree.root;
    if (here && !inside) occurrences.push(node);
    for (const child of node.children) visit(child, inside || here);
  };
  if (tree?.root) visit(tree.root, false);
  const fresh = (nodeName) => ({ name: nodeName, total: 0, self: 0, children: new Map() });
  const callees = fresh(name);
  const merge = (into, from) => {
    into.total += from.total;
    into.self += from.self;
    for (const child of from.children) {
      if (!into.children.has(child.name)) into.children.set(child.name, fresh(child.name));
      merge(into.children.get(child.name), child);
    }
  };
  const callers = fresh(name);
  for (const occurrence of occurrences) {
    merge(callees, occurrence);
    callers.total += occurrence.total;
    let at = callers;
    for (let caller = occurrence.parent; caller && caller !== tree.root; caller = caller.parent) {
      if (!at.children.has(caller.name)) at.children.set(caller.name, fresh(caller.name));
      at = at.children.get(caller.name);
      at.total += occurrence.total;
    }
  }
  return { callers: finishTree(callers), callees: finishTree(callees) };
}

/** A merged `{name, total, self, children: Map}` tree as a drawable tree: x, depth, ids. */
function finishTree(top) {
  const nodes = [];
  let maxSelf = 0;
  const root = makeNode(0, top.name, 0, 0, top.total, 0);
  const queue = [[top, root]];
  while (queue.length) {
    const [source, node] = queue.shift();
    node.id = nodes.length;
    nodes.push(node);
    let x = node.x;
    let childTotal = 0;
    for (const child of [...source.children.values()].sort((a, b) => b.total - a.total)) {
      const made = makeNode(0, child.name, node.depth + 1, x, child.total, 0);
      made.parent = node;
      node.children.push(made);
      x += child.total;
      childTotal += child.total;
      queue.push([child, made]);
    }
    // Self is what the children do not cover (callers' trees have no self of their own).
    node.self = Math.max(0, node.total - childTotal);
    maxSelf = Math.max(maxSelf, node.self);
  }
  return { root, nodes, total: root.total, maxSelf, diff: false };
}
