// The web UI: pickers, time range, flame graph, top table, compare, pprof download, GPU and
// health panels. Talks to the agent's Connect query API in JSON (same origin; with
// --auth-token the page was opened once as /?token=… and a cookie carries the token).
import { drawBarChart, drawLineChart } from './charts.mjs';
import {
  decodeDiff,
  decodeFlamegraph,
  formatPercent,
  formatValue,
  labelSelector,
  matcher,
  sandwich,
  serviceSelector,
  shareChange,
  sortRows,
  topFunctions,
  unitOf,
} from './flamegraph.mjs';
import { FlameView } from './flameview.mjs';

const $ = (id) => document.getElementById(id);

const PRESETS = [
  ['5m', 5 * 60e3],
  ['15m', 15 * 60e3],
  ['1h', 3600e3],
  ['6h', 6 * 3600e3],
  ['24h', 24 * 3600e3],
  ['7d', 7 * 24 * 3600e3],
];
const DEFAULT_PROFILE_TYPE = 'process_cpu:cpu:nanoseconds:cpu:nanoseconds';
// A service with off-CPU profiles has a wall-clock view: its CPU and off-CPU time together.
const OFF_CPU_PROFILE_TYPE = 'off_cpu:off_cpu:nanoseconds:off_cpu:nanoseconds';
const WALL_PROFILE_TYPE = 'wall:wall:nanoseconds:wall:nanoseconds';
const TABLE_ROWS = 300;
const HEALTH_EVERY_MS = 5000;
const LIVE_EVERY_MS = 15000;

/** Colours of the timeline's groups (distinct also for the red-green colour blind). */
const GROUP_COLOURS = ['#1c7ed6', '#e8590c', '#7048e8', '#0ca678', '#d6336c', '#868e96', '#f59f00', '#1098ad'];
const MAX_GROUPS = GROUP_COLOURS.length;

const state = {
  service: '',
  // A label the timeline is split by (one line per value), or ''.
  groupBy: '',
  // The function whose callers and callees are shown (the sandwich view), or ''.
  sandwich: '',
  // Label filters ([{name, value}]) narrowing the service: SDK tags, pod, thread, executable.
  filters: [],
  // Flame graph, top table, or both side by side.
  view: 'both',
  profileType: '',
  preset: '1h',
  // Custom range in ms (when preset is '').
  from: 0,
  until: 0,
  mode: 'single',
  compare: { baseFrom: 0, baseUntil: 0, compFrom: 0, compUntil: 0 },
  search: '',
  sort: { key: 'self', descending: true },
  profileTypes: [],
  // Where the timeline has data: the default compare ranges split it.
  dataSpan: null,
};

class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function request(url, options = {}) {
  const response = await fetch(url, { credentials: 'same-origin', ...options });
  if (!response.ok) {
    let message = `${response.status} ${response.statusText}`;
    try {
      const body = await response.json();
      if (body?.message) message = body.message;
    } catch {
      // Not JSON; keep the status line.
    }
    if (response.status === 401) {
      showBanner('Not authorized: this agent needs its token. Open the page once as /?token=<your token>.');
    }
    throw new HttpError(response.status, message);
  }
  return response;
}

async function rpc(method, body) {
  const response = await request(`/querier.v1.QuerierService/${method}`, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json', 'Connect-Protocol-Version': '1' },
    body: JSON.stringify(body),
  });
  return response.json();
}

function showBanner(text) {
  const banner = $('banner');
  banner.textContent = text;
  banner.hidden = !text;
}

/** The selected range in ms: a preset ends now. */
function currentRange() {
  if (state.preset) {
    const span = PRESETS.find(([name]) => name === state.preset)?.[1] ?? 3600e3;
    const until = Date.now();
    return { from: until - span, until };
  }
  return { from: state.from, until: state.until };
}

// ---- URL hash: the view can be bookmarked and shared ----

function readHash() {
  const params = new URLSearchParams(location.hash.slice(1));
  state.service = params.get('service') ?? state.service;
  state.profileType = params.get('type') ?? state.profileType;
  const preset = params.get('range');
  if (preset && PRESETS.some(([name]) => name === preset)) state.preset = preset;
  const from = Number(params.get('from'));
  const until = Number(params.get('until'));
  if (from > 0 && until > from) {
    state.preset = '';
    state.from = from;
    state.until = until;
  }
  state.search = params.get('search') ?? '';
  state.sandwich = params.get('sandwich') ?? '';
  state.groupBy = params.get('group') ?? '';
  state.filters = params
    .getAll('filter')
    .map((text) => text.split(/=(.*)/s))
    .filter(([name, value]) => name && value !== undefined)
    .map(([name, value]) => ({ name, value }));
  const view = params.get('view');
  if (['flame', 'table', 'both'].includes(view)) state.view = view;
  // Compare mode and its two ranges.
  const compare = ['base_from', 'base_until', 'comp_from', 'comp_until'].map((k) => Number(params.get(k)));
  state.hashCompare =
    params.get('mode') === 'compare' && compare[0] < compare[1] && compare[2] < compare[3] && compare[0] > 0
      ? {
          baseFrom: compare[0],
          baseUntil: compare[1],
          compFrom: compare[2],
          compUntil: compare[3],
          compService: params.get('comp_service') ?? '',
        }
      : null;
  state.hashMode = params.get('mode') === 'compare' ? 'compare' : 'single';
}

function writeHash() {
  const params = new URLSearchParams();
  if (state.service) params.set('service', state.service);
  if (state.profileType) params.set('type', state.profileType);
  if (state.preset) params.set('range', state.preset);
  else {
    params.set('from', String(state.from));
    params.set('until', String(state.until));
  }
  if (state.search) params.set('search', state.search);
  if (state.sandwich) params.set('sandwich', state.sandwich);
  if (state.groupBy) params.set('group', state.groupBy);
  for (const { name, value } of state.filters) params.append('filter', `${name}=${value}`);
  if (state.view !== 'both') params.set('view', state.view);
  if (state.mode === 'compare' && state.compare) {
    params.set('mode', 'compare');
    params.set('base_from', String(state.compare.baseFrom));
    params.set('base_until', String(state.compare.baseUntil));
    params.set('comp_from', String(state.compare.compFrom));
    params.set('comp_until', String(state.compare.compUntil));
    if (state.compare.compService) params.set('comp_service', state.compare.compService);
  }
  history.replaceState(null, '', `${location.pathname}${location.search}#${params}`);
}

/** The token in ?token=… has become a cookie; take it out of the address bar and history. */
function hideTokenFromAddressBar() {
  const url = new URL(location.href);
  if (url.searchParams.has('token')) {
    url.searchParams.delete('token');
    history.replaceState(null, '', url.pathname + url.search + url.hash);
  }
}

// ---- time inputs ----

function toLocalInput(ms) {
  const d = new Date(ms);
  const pad = (n) => String(n).padStart(2, '0');
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())}T${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

function fromLocalInput(value) {
  const ms = new Date(value).getTime();
  return Number.isFinite(ms) ? ms : NaN;
}

function readRangeInputs(fromInput, untilInput) {
  const from = fromLocalInput(fromInput.value);
  const until = fromLocalInput(untilInput.value);
  if (!Number.isFinite(from) || !Number.isFinite(until)) throw new Error('enter both times');
  if (from >= until) throw new Error('the start must be before the end');
  return { from, until };
}

function describeRange({ from, until }) {
  const f = new Date(from);
  const u = new Date(until);
  const sameDay = f.toDateString() === u.toDateString();
  const time = (d) => d.toLocaleTimeString([], { hour: '2-digit', minute: '2-digit', second: '2-digit' });
  return sameDay
    ? `${f.toLocaleDateString()} ${time(f)} – ${time(u)}`
    : `${f.toLocaleString()} – ${u.toLocaleString()}`;
}

// ---- pickers ----

/** The agent's CPU profile: what the service overview ranks services by. */
const CPU_TYPE = 'process_cpu:cpu:nanoseconds:cpu:nanoseconds';

/** CPU time per service over the range (empty when no CPU profiles were stored). */
async function cpuByService(from, until) {
  try {
    const response = await rpc('SelectSeries', {
      profileTypeID: CPU_TYPE,
      labelSelector: '{}',
      start: String(from),
      end: String(until),
      step: Math.max(1, Math.ceil((until - from) / 1000)),
      groupBy: ['service_name'],
    });
    const totals = new Map();
    for (const series of response.series ?? []) {
      const name = (series.labels ?? []).find((l) => l.name === 'service_name')?.value;
      if (!name) continue;
      const total = (series.points ?? []).reduce((sum, p) => sum + Number(p.value), 0);
      totals.set(name, (totals.get(name) ?? 0) + total);
    }
    return totals;
  } catch {
    return new Map();
  }
}

async function loadServices() {
  const { from, until } = currentRange();
  const [response, cpu] = await Promise.all([
    rpc('LabelValues', {
      name: 'service_name',
      matchers: [],
      start: String(from),
      end: String(until),
    }),
    cpuByService(from, until),
  ]);
  // Busiest first (by CPU over the range), then by name: the default is the busiest service,
  // not the alphabetically first.
  const services = (response.names ?? []).slice().sort((a, b) => (cpu.get(b) ?? 0) - (cpu.get(a) ?? 0) || a.localeCompare(b));
  if (state.service && !services.includes(state.service)) services.unshift(state.service);
  if (!state.service && services.length) state.service = services[0];
  state.services = services;
  fillServiceOptions();
  $('service').dataset.count = String(services.length);
  drawServiceOverview(cpu);
}

/** The service picker's options, narrowed by the filter box (the selected one always stays). */
function fillServiceOptions() {
  const select = $('service');
  const filter = $('service-filter').value.trim().toLowerCase();
  const services = (state.services ?? []).filter((s) => !filter || s.toLowerCase().includes(filter) || s === state.service);
  select.textContent = '';
  if (!services.length) select.appendChild(new Option('(no services yet)', ''));
  for (const service of services) select.appendChild(new Option(service, service));
  select.value = state.service;
  // Compare may set another service against this one.
  const other = $('comp-service');
  const chosen = other.value || state.compare?.compService || '';
  other.textContent = '';
  other.appendChild(new Option('the same service', ''));
  for (const service of state.services ?? []) other.appendChild(new Option(service, service));
  other.value = (state.services ?? []).includes(chosen) ? chosen : '';
}

/** The services with the most CPU in the range, as bars; a click selects one. */
function drawServiceOverview(cpu) {
  const list = $('service-overview');
  list.textContent = '';
  const total = [...cpu.values()].reduce((a, b) => a + b, 0);
  const top = [...cpu.entries()].sort((a, b) => b[1] - a[1]).slice(0, 12);
  $('services-panel').hidden = top.length === 0;
  for (const [service, value] of top) {
    const row = document.createElement('button');
    row.type = 'button';
    row.className = 'service-row';
    row.dataset.service = service;
    row.dataset.share = String(total ? value / total : 0);
    row.setAttribute('aria-pressed', String(service === state.service));
    const bar = document.createElement('span');
    bar.className = 'service-bar';
    bar.style.width = `${total ? (100 * value) / total : 0}%`;
    const label = document.createElement('span');
    label.className = 'service-label';
    label.textContent = `${service} · ${formatPercent(value, total)}`;
    const gpu = document.createElement('span');
    gpu.className = 'service-gpu';
    row.append(bar, label, gpu);
    row.addEventListener('click', () => selectService(service));
    list.appendChild(row);
  }
  markServiceGpu();
}

/**
 * Adds each overview row's GPU use (from /api/gpu's `services`: mean SM utilization and peak
 * memory over the range) where NVML saw the service's processes on a GPU.
 */
function markServiceGpu() {
  const gpu = state.gpuServices ?? new Map();
  for (const row of document.querySelectorAll('#service-overview .service-row')) {
    const use = gpu.get(row.dataset.service);
    const cell = row.querySelector('.service-gpu');
    if (!cell) continue;
    if (use) {
      row.dataset.gpuSm = String(use.sm_util);
      cell.textContent = ` · GPU SM ${Number(use.sm_util).toFixed(0)}%, ${formatValue(Number(use.max_mem_used_bytes), 'bytes')}`;
      cell.title = 'Mean SM utilization of its processes over the range (percent of one GPU) and their peak GPU memory (NVML)';
    } else {
      delete row.dataset.gpuSm;
      cell.textContent = '';
    }
  }
  const title = $('services-title');
  if (title) title.textContent = gpu.size ? 'Services by CPU (and GPU)' : 'Services by CPU';
}

/** The selector of every query: the service and the label filters. */
function currentSelector() {
  return labelSelector(state.service, state.filters);
}

// ---- label filters ----

/** The label names of the service's series (SDK tags, pod, thread_name, executable...). */
async function loadLabelNames() {
  const { from, until } = currentRange();
  const select = $('filter-name');
  const response = await rpc('LabelNames', {
    matchers: [currentSelector()],
    start: String(from),
    end: String(until),
  });
  const taken = new Set(state.filters.map((f) => f.name));
  const names = (response.names ?? []).filter((n) => !n.startsWith('__') && n !== 'service_name' && !taken.has(n));
  select.textContent = '';
  select.appendChild(new Option('label…', ''));
  for (const name of names) select.appendChild(new Option(name, name));
  const group = $('group-by');
  group.textContent = '';
  group.appendChild(new Option('group by…', ''));
  const groupable = (response.names ?? []).filter((n) => !n.startsWith('__') && n !== 'service_name');
  if (state.groupBy && !groupable.includes(state.groupBy)) groupable.push(state.groupBy);
  for (const name of groupable) group.appendChild(new Option(name, name));
  group.value = state.groupBy;
  $('filter-value').textContent = '';
  $('filter-value').disabled = true;
  $('filter-add').disabled = true;
}

async function loadLabelValues(name) {
  const values = $('filter-value');
  values.textContent = '';
  values.disabled = true;
  $('filter-add').disabled = true;
  if (!name) return;
  const { from, until } = currentRange();
  const response = await rpc('LabelValues', {
    name,
    matchers: [currentSelector()],
    start: String(from),
    end: String(until),
  });
  for (const value of response.names ?? []) values.appendChild(new Option(value, value));
  values.disabled = !values.options.length;
  $('filter-add').disabled = !values.options.length;
}

function renderFilters() {
  const box = $('filters');
  box.textContent = '';
  for (const [index, { name, value }] of state.filters.entries()) {
    const chip = document.createElement('button');
    chip.type = 'button';
    chip.className = 'chip';
    chip.dataset.name = name;
    chip.dataset.value = value;
    chip.title = 'Remove this filter';
    chip.textContent = `${name}=${value} ×`;
    chip.addEventListener('click', () => {
      state.filters.splice(index, 1);
      filtersChanged();
    });
    box.appendChild(chip);
  }
}

async function filtersChanged() {
  renderFilters();
  writeHash();
  view.reset();
  try {
    await loadLabelNames();
  } catch (err) {
    setStatus(err.message, true);
  }
  state.mode === 'compare' ? runCompare() : loadFlamegraph();
}

// ---- sandwich view: callers and callees of one function ----

let sandwichViews = null;

function openSandwich(name) {
  state.sandwich = name;
  writeHash();
  drawSandwich();
}

function closeSandwich() {
  state.sandwich = '';
  writeHash();
  drawSandwich();
}

/** Draws the sandwich of `state.sandwich` from the flame graph's tree (not in compare mode). */
function drawSandwich() {
  const section = $('sandwich');
  const tree = view?.tree;
  if (!state.sandwich || !tree || tree.diff || state.mode === 'compare') {
    section.hidden = true;
    return;
  }
  sandwichViews ??= {
    callers: new FlameView($('sandwich-callers'), $('tooltip'), $('sandwich-callers-frames'), () => {}),
    callees: new FlameView($('sandwich-callees'), $('tooltip'), $('sandwich-callees-frames'), () => {}),
  };
  const { callers, callees } = sandwich(tree, state.sandwich);
  const unit = unitOf(state.profileType);
  section.hidden = false;
  $('sandwich-name').textContent = state.sandwich;
  sandwichViews.callers.setTree(callers, unit);
  sandwichViews.callees.setTree(callees, unit);
  section.dataset.total = String(callers.total);
}

async function selectService(service) {
  // Another service's labels may not apply: its filters start empty.
  if (service !== state.service) state.filters = [];
  renderFilters();
  state.service = service;
  fillServiceOptions();
  for (const row of $('service-overview').querySelectorAll('.service-row')) {
    row.setAttribute('aria-pressed', String(row.dataset.service === service));
  }
  view.reset();
  try {
    await loadProfileTypes();
    await loadLabelNames();
  } catch (err) {
    setStatus(err.message, true);
  }
  writeHash();
  state.mode === 'compare' ? runCompare() : loadFlamegraph();
  loadGpu();
}

function profileTypeLabel(type) {
  if (type.ID === WALL_PROFILE_TYPE) return 'wall · on-CPU + off-CPU (nanoseconds)';
  const parts = type.ID.split(':');
  const [name, sampleType, unit] = parts;
  return `${name} · ${sampleType} (${unit})`;
}

async function loadProfileTypes() {
  const { from, until } = currentRange();
  const [all, forService] = await Promise.all([
    rpc('ProfileTypes', { start: String(from), end: String(until) }),
    state.service
      ? rpc('LabelValues', {
          name: '__profile_type__',
          matchers: [serviceSelector(state.service)],
          start: String(from),
          end: String(until),
        })
      : Promise.resolve({ names: null }),
  ]);
  let types = all.profileTypes ?? [];
  if (forService.names) {
    const own = new Set(forService.names);
    if (own.has(OFF_CPU_PROFILE_TYPE)) own.add(WALL_PROFILE_TYPE);
    types = types.filter((t) => own.has(t.ID));
  }
  state.profileTypes = types;
  const select = $('profile-type');
  select.textContent = '';
  for (const type of types) select.appendChild(new Option(profileTypeLabel(type), type.ID));
  const ids = types.map((t) => t.ID);
  if (!ids.includes(state.profileType)) {
    state.profileType = ids.includes(DEFAULT_PROFILE_TYPE) ? DEFAULT_PROFILE_TYPE : (ids[0] ?? '');
  }
  if (!ids.length) select.appendChild(new Option('(no profiles in range)', ''));
  select.value = state.profileType;
}

// ---- the flame graph, timeline, table ----

let view;
let loadSequence = 0;

function setStatus(text, isError = false) {
  const status = $('status');
  status.textContent = text;
  status.classList.toggle('error', isError);
}

/** Says which query the view shows (lets the browser tests wait for a specific result). */
function markDone(what) {
  $('status').dataset.done = what;
}

function downloadHref(range) {
  const params = new URLSearchParams({
    query: `${state.profileType}${currentSelector()}`,
    from: String(Math.round(range.from)),
    until: String(Math.round(range.until)),
  });
  return `/api/pprof?${params}`;
}

async function loadFlamegraph(keepZoom = false) {
  const sequence = ++loadSequence;
  const range = currentRange();
  $('range-label').textContent = describeRange(range);
  const link = $('download');
  if (!state.service || !state.profileType) {
    view.setTree(null, '');
    link.removeAttribute('href');
    link.setAttribute('aria-disabled', 'true');
    setStatus(state.service ? 'No profiles of this service in the selected range.' : 'No services have sent profiles in the selected range yet.');
    renderTable();
    return;
  }
  link.href = downloadHref(range);
  link.setAttribute('aria-disabled', 'false');
  setStatus('Loading…');
  const query = {
    profileTypeID: state.profileType,
    labelSelector: currentSelector(),
    start: String(Math.round(range.from)),
    end: String(Math.round(range.until)),
  };
  try {
    const [merge] = await Promise.all([
      rpc('SelectMergeStacktraces', { ...query, format: 'PROFILE_FORMAT_FLAMEGRAPH' }),
      loadTimeline(query, range, sequence),
    ]);
    if (sequence !== loadSequence) return;
    const tree = decodeFlamegraph(merge.flamegraph);
    queueMicrotask(drawSandwich);
    const unit = unitOf(state.profileType);
    view.setTree(tree, unit, keepZoom);
    markDone(`single:${state.service}:${state.preset || `${state.from}-${state.until}`}`);
    setStatus(
      tree.total > 0
        ? `${formatValue(tree.total, unit)} in total, ${tree.nodes.length} frames`
        : 'No samples of this service in the selected range.',
    );
  } catch (err) {
    if (sequence !== loadSequence) return;
    view.setTree(null, '');
    setStatus(`Query failed: ${err.message}`, true);
  }
}

async function loadTimeline(query, range, sequence) {
  const step = Math.max(1, Math.round((range.until - range.from) / 1000 / 120));
  const canvas = $('timeline');
  try {
    const groupBy = state.groupBy ? [state.groupBy] : [];
    const response = await rpc('SelectSeries', { ...query, step, groupBy });
    if (sequence !== loadSequence) return;
    const series = response.series ?? [];
    const pointsOf = (s) => (s.points ?? []).map((p) => ({ t: Number(p.timestamp), v: Number(p.value) }));
    const points = series.flatMap(pointsOf);
    if (state.groupBy) {
      drawGroups(canvas, series, pointsOf, range);
    } else {
      $('group-legend').hidden = true;
      canvas.dataset.groups = '0';
      drawBarChart(canvas, points, {
        from: range.from,
        until: range.until,
        stepMs: step * 1000,
        color: '#e8590c',
      });
    }
    state.timelineRange = range;
    canvas.dataset.points = String(points.length);
    const times = points.filter((p) => p.v > 0).map((p) => p.t);
    // SelectSeries stamps a point with its bucket's right edge.
    state.dataSpan = times.length
      ? { from: Math.max(range.from, Math.min(...times) - step * 1000), until: Math.max(...times) }
      : null;
  } catch {
    drawBarChart(canvas, [], { from: range.from, until: range.until, stepMs: step * 1000 });
  }
}

/** One line per value of the group-by label (the largest `MAX_GROUPS`), and their legend:
 * clicking a value filters by it. */
function drawGroups(canvas, series, pointsOf, range) {
  const groups = series
    .map((s) => ({
      value: (s.labels ?? []).find((l) => l.name === state.groupBy)?.value ?? '(none)',
      points: pointsOf(s),
    }))
    .map((g) => ({ ...g, total: g.points.reduce((sum, p) => sum + p.v, 0) }))
    .sort((a, b) => b.total - a.total)
    .slice(0, MAX_GROUPS);
  drawLineChart(
    canvas,
    groups.map((g, i) => ({ color: GROUP_COLOURS[i], points: g.points })),
    { from: range.from, until: range.until, height: 48, axis: true },
  );
  canvas.dataset.groups = String(groups.length);
  const legend = $('group-legend');
  legend.textContent = '';
  legend.hidden = groups.length === 0;
  groups.forEach((group, i) => {
    const item = document.createElement('button');
    item.type = 'button';
    item.dataset.value = group.value;
    item.title = `Filter by ${state.groupBy}=${group.value}`;
    const swatch = document.createElement('i');
    swatch.style.background = GROUP_COLOURS[i];
    item.append(swatch, `${group.value}`);
    item.addEventListener('click', () => {
      if (group.value === '(none)') return;
      state.filters.push({ name: state.groupBy, value: group.value });
      filtersChanged();
    });
    legend.appendChild(item);
  });
}

/** Called by the view after each redraw: search status, zoom breadcrumb, table. */
function onViewChange({ tree, focus, search }) {
  const searchStatus = $('search-status');
  if (!state.search.trim() || !tree) {
    searchStatus.textContent = '';
  } else if (search?.error) {
    searchStatus.textContent = `invalid expression: ${search.error}`;
  } else {
    const unit = unitOf(state.profileType);
    searchStatus.textContent = `${search.matched.size} ${search.matched.size === 1 ? 'frame matches' : 'frames match'} · ${search.percent.toFixed(2)}% (${formatValue(search.value, unit)})${focus && focus !== tree.root ? ' of the zoomed frame' : ''}`;
  }
  searchStatus.dataset.percent = search ? search.percent.toFixed(4) : '0';
  searchStatus.dataset.matches = String(search?.matched.size ?? 0);
  const crumbs = $('breadcrumb');
  crumbs.textContent = '';
  if (tree && focus && focus !== tree.root) {
    const chain = [];
    for (let n = focus; n; n = n.parent) chain.unshift(n);
    chain.forEach((node, i) => {
      const button = document.createElement('button');
      button.type = 'button';
      button.className = 'crumb';
      button.textContent = node === tree.root ? 'all' : node.name;
      button.addEventListener('click', () => view.zoom(node));
      if (i) crumbs.append(' › ');
      crumbs.appendChild(button);
    });
  }
  $('reset-zoom').disabled = !tree || !focus || focus === tree.root;
  if (tree !== renderTable.tree) renderTable();
  else filterTable();
}

const SINGLE_COLUMNS = [
  ['name', 'Function'],
  ['self', 'Self'],
  ['total', 'Total'],
];
const DIFF_COLUMNS = [
  ['name', 'Function'],
  ['leftSelf', 'Baseline self'],
  ['rightSelf', 'Comparison self'],
  ['selfChange', 'Self change'],
  ['leftTotal', 'Baseline total'],
  ['rightTotal', 'Comparison total'],
  ['totalChange', 'Total change'],
];

function renderTable() {
  const tree = view.tree;
  renderTable.tree = tree;
  const table = $('top-table');
  const head = table.tHead;
  const body = table.tBodies[0];
  head.textContent = '';
  body.textContent = '';
  const columns = tree?.diff ? DIFF_COLUMNS : SINGLE_COLUMNS;
  if (!columns.some(([key]) => key === state.sort.key)) {
    state.sort = { key: tree?.diff ? 'totalChange' : 'self', descending: true };
  }
  const headRow = head.insertRow();
  for (const [key, label] of columns) {
    const th = document.createElement('th');
    th.scope = 'col';
    const button = document.createElement('button');
    button.type = 'button';
    button.textContent = label;
    button.dataset.sort = key;
    button.addEventListener('click', () => {
      state.sort =
        state.sort.key === key
          ? { key, descending: !state.sort.descending }
          : { key, descending: key !== 'name' };
      renderTable();
    });
    th.appendChild(button);
    if (state.sort.key === key) th.setAttribute('aria-sort', state.sort.descending ? 'descending' : 'ascending');
    if (key !== 'name') th.className = 'num';
    headRow.appendChild(th);
  }
  if (!tree || tree.total <= 0) {
    $('table-note').textContent = '';
    return;
  }
  const unit = unitOf(state.profileType);
  const fmt = (v) => formatValue(v, unit);
  let rows = topFunctions(tree);
  if (tree.diff) {
    for (const row of rows) {
      const sides = (left, right) => ({ left: { total: left }, right: { total: right } });
      row.selfChange = shareChange(sides(row.leftSelf, row.rightSelf), tree.leftTicks, tree.rightTicks);
      row.totalChange = shareChange(sides(row.leftTotal, row.rightTotal), tree.leftTicks, tree.rightTicks);
    }
  }
  rows = sortRows(rows, state.sort.key, state.sort.descending);
  renderTable.rows = rows;
  for (const row of rows) {
    const tr = body.insertRow();
    tr.dataset.name = row.name;
    const nameCell = tr.insertCell();
    const nameButton = document.createElement('button');
    nameButton.type = 'button';
    nameButton.className = 'fn';
    nameButton.textContent = row.name;
    nameButton.title = 'Highlight in the flame graph';
    nameButton.addEventListener('click', () => setSearch(row.name));
    nameCell.appendChild(nameButton);
    if (!tree.diff) {
      const sandwichButton = document.createElement('button');
      sandwichButton.type = 'button';
      sandwichButton.className = 'sandwich-button';
      sandwichButton.textContent = 'sandwich';
      sandwichButton.title = 'Callers and callees of this function';
      sandwichButton.addEventListener('click', () => openSandwich(row.name));
      nameCell.appendChild(sandwichButton);
    }
    const cell = (text, value) => {
      const td = tr.insertCell();
      td.className = 'num';
      td.textContent = text;
      if (value !== undefined) td.dataset.value = String(value);
    };
    if (tree.diff) {
      cell(`${fmt(row.leftSelf)} (${formatPercent(row.leftSelf, tree.leftTicks)})`, row.leftSelf);
      cell(`${fmt(row.rightSelf)} (${formatPercent(row.rightSelf, tree.rightTicks)})`, row.rightSelf);
      const change = (value) => {
        const points = 100 * value;
        cell(`${points >= 0 ? '+' : ''}${points.toFixed(2)} pts`, value);
        tr.lastChild.classList.add(points > 0.005 ? 'worse' : points < -0.005 ? 'better' : 'same');
      };
      change(row.selfChange);
      cell(`${fmt(row.leftTotal)} (${formatPercent(row.leftTotal, tree.leftTicks)})`, row.leftTotal);
      cell(`${fmt(row.rightTotal)} (${formatPercent(row.rightTotal, tree.rightTicks)})`, row.rightTotal);
      change(row.totalChange);
    } else {
      cell(`${fmt(row.self)} (${formatPercent(row.self, tree.total)})`, row.self);
      cell(`${fmt(row.total)} (${formatPercent(row.total, tree.total)})`, row.total);
    }
  }
  filterTable();
}

/** Shows only rows matching the search, at most TABLE_ROWS of them. */
function filterTable() {
  const body = $('top-table').tBodies[0];
  const match = matcher(state.search);
  let shown = 0;
  let matching = 0;
  for (const tr of body.rows) {
    const hit = match.empty || match.test(tr.dataset.name);
    if (hit) matching++;
    const visible = hit && shown < TABLE_ROWS;
    if (visible) shown++;
    tr.hidden = !visible;
  }
  $('table-note').textContent =
    matching > shown ? `showing ${shown} of ${matching} functions` : `${matching} functions`;
}

function setSearch(text) {
  state.search = text;
  $('search').value = text;
  view.setSearch(text);
  writeHash();
}

// ---- compare ----

/** The two halves of the selected range, or of the part of it that has data. */
/** Two halves of equal length (whole seconds, as the inputs show them) of the data's span. */
function defaultCompareRanges() {
  const { from, until } = state.dataSpan ?? currentRange();
  const start = Math.floor(from / 1000) * 1000;
  const half = Math.max(1000, Math.floor((until - start) / 2000) * 1000);
  setCompareRanges({ baseFrom: start, baseUntil: start + half, compFrom: start + half, compUntil: start + 2 * half });
}

function setCompareRanges(ranges) {
  state.compare = ranges;
  $('base-from').value = toLocalInput(ranges.baseFrom);
  $('base-until').value = toLocalInput(ranges.baseUntil);
  $('comp-from').value = toLocalInput(ranges.compFrom);
  $('comp-until').value = toLocalInput(ranges.compUntil);
  if (ranges.compService !== undefined) {
    if (![...$('comp-service').options].some((o) => o.value === ranges.compService)) {
      $('comp-service').appendChild(new Option(ranges.compService, ranges.compService));
    }
    $('comp-service').value = ranges.compService;
  }
}

async function runCompare() {
  const sequence = ++loadSequence;
  let base;
  let comp;
  try {
    base = readRangeInputs($('base-from'), $('base-until'));
    comp = readRangeInputs($('comp-from'), $('comp-until'));
  } catch (err) {
    setStatus(`Compare: ${err.message}`, true);
    return;
  }
  if (!state.service || !state.profileType) {
    setStatus('Pick a service first.', true);
    return;
  }
  // The comparison may be another service (with the same label filters): any two selections.
  const compService = $('comp-service').value;
  state.compare = {
    baseFrom: base.from,
    baseUntil: base.until,
    compFrom: comp.from,
    compUntil: comp.until,
    compService,
  };
  writeHash();
  const side = (range, service) => ({
    profileTypeID: state.profileType,
    labelSelector: service ? labelSelector(service, state.filters) : currentSelector(),
    start: String(range.from),
    end: String(range.until),
  });
  setStatus('Comparing…');
  $('range-label').textContent = `${describeRange(base)}  vs  ${describeRange(comp)}`;
  $('download').href = downloadHref(comp);
  try {
    const response = await rpc('Diff', { left: side(base, ''), right: side(comp, compService) });
    if (sequence !== loadSequence) return;
    const tree = decodeDiff(response.flamegraph);
    const unit = unitOf(state.profileType);
    view.setTree(tree, unit);
    const against = compService ? `:vs:${compService}` : '';
    markDone(`compare:${state.service}:${base.from}-${base.until}:${comp.from}-${comp.until}${against}`);
    const empty = [tree.leftTicks ? '' : 'the baseline', tree.rightTicks ? '' : 'the comparison'].filter(Boolean);
    setStatus(
      `Baseline ${formatValue(tree.leftTicks, unit)}, comparison ${formatValue(tree.rightTicks, unit)}. ` +
        (empty.length
          ? `No profiles in ${empty.join(' and ')} range.`
          : 'Red: larger share in the comparison; blue: smaller.'),
      empty.length > 0,
    );
  } catch (err) {
    if (sequence !== loadSequence) return;
    view.setTree(null, '');
    setStatus(`Compare failed: ${err.message}`, true);
  }
}

/** Shows `mode`'s controls; compare starts from the ranges in the URL, else the default. */
function showMode(mode) {
  state.mode = mode;
  for (const tab of document.querySelectorAll('[role=tab]')) {
    tab.setAttribute('aria-selected', String(tab.dataset.mode === mode));
  }
  $('compare-controls').hidden = mode !== 'compare';
  document.body.dataset.mode = mode;
  drawSandwich();
  if (mode !== 'compare') return;
  if (state.hashCompare) {
    setCompareRanges(state.hashCompare);
    state.hashCompare = null;
  } else {
    defaultCompareRanges();
  }
}

function setMode(mode) {
  showMode(mode);
  if (mode === 'compare') {
    runCompare();
  } else {
    writeHash();
    loadFlamegraph();
  }
}

// ---- refresh ----

async function refresh(keepZoom = false) {
  showBanner('');
  try {
    await loadServices();
    await loadProfileTypes();
    renderFilters();
    await loadLabelNames();
  } catch (err) {
    setStatus(`Cannot reach the agent: ${err.message}`, true);
    return;
  }
  writeHash();
  if (state.mode === 'compare') await runCompare();
  else await loadFlamegraph(keepZoom);
  loadGpu();
}

// ---- GPU panel ----

async function loadGpu() {
  const panel = $('gpu-panel');
  const note = $('gpu-note');
  const { from, until } = state.mode === 'compare'
    ? { from: state.compare.baseFrom, until: state.compare.compUntil }
    : currentRange();
  let body;
  try {
    const service = state.service ? `&service=${encodeURIComponent(state.service)}` : '';
    const response = await fetch(`/api/gpu?from=${Math.round(from)}&until=${Math.round(until)}${service}`, {
      credentials: 'same-origin',
    });
    if (response.status === 404) {
      panel.hidden = true;
      note.hidden = true;
      state.gpuServices = new Map();
      markServiceGpu();
      return;
    }
    if (!response.ok) throw new Error(`${response.status}`);
    body = await response.json();
    state.gpuServices = new Map((body?.services ?? []).map((s) => [s.name, s]));
    markServiceGpu();
  } catch (err) {
    state.gpuServices = new Map();
    markServiceGpu();
    panel.hidden = true;
    note.hidden = false;
    note.textContent = `GPU metrics unavailable (${err.message}).`;
    return;
  }
  if (!body?.available) {
    panel.hidden = true;
    note.hidden = false;
    note.textContent = `No GPU metrics${body?.reason ? `: ${body.reason}` : ''}.`;
    return;
  }
  note.hidden = true;
  panel.hidden = false;
  const list = $('gpu-list');
  list.textContent = '';
  if (body.service) list.appendChild(serviceGpuItem(body.service, from, until));
  for (const gpu of body.gpus ?? []) {
    const points = gpu.points ?? [];
    const item = document.createElement('div');
    item.className = 'gpu';
    item.dataset.index = String(gpu.index);
    const title = document.createElement('div');
    title.className = 'gpu-title';
    title.textContent = `GPU ${gpu.index} · ${gpu.name ?? ''}`;
    title.title = gpu.uuid ?? '';
    item.appendChild(title);
    const stats = document.createElement('div');
    stats.className = 'gpu-stats small';
    if (points.length) {
      const avg = points.reduce((s, p) => s + Number(p.util), 0) / points.length;
      const peak = Math.max(...points.map((p) => Number(p.util)));
      const last = points.reduce((a, b) => (Number(b.t) > Number(a.t) ? b : a));
      stats.textContent =
        `util avg ${avg.toFixed(0)}%, peak ${peak.toFixed(0)}% · memory ` +
        `${formatValue(Number(last.mem_used_bytes), 'bytes')} / ${formatValue(Number(last.mem_total_bytes), 'bytes')}`;
    } else {
      stats.textContent = 'no samples in this range';
    }
    item.appendChild(stats);
    const canvas = document.createElement('canvas');
    canvas.className = 'gpu-chart';
    canvas.setAttribute('role', 'img');
    canvas.setAttribute('aria-label', `GPU ${gpu.index} utilization over the selected range`);
    item.appendChild(canvas);
    list.appendChild(item);
    drawLineChart(
      canvas,
      [
        { points: points.map((p) => ({ t: Number(p.t), v: Number(p.util) })), color: '#2f9e44' },
        {
          points: points.map((p) => ({ t: Number(p.t), v: Number(p.mem_util) })),
          color: '#1c7ed6',
          dashed: true,
        },
      ],
      { from, until, max: 100, fill: true, height: 56 },
    );
  }
}

// The selected service's own GPU use: its processes' SM utilization (summed, % of one GPU)
// and device memory, over the selected range.
function serviceGpuItem(service, from, until) {
  const points = service.points ?? [];
  const item = document.createElement('div');
  item.className = 'gpu gpu-service';
  item.dataset.service = service.name;
  const title = document.createElement('div');
  title.className = 'gpu-title';
  title.textContent = `${service.name} on the GPUs`;
  item.appendChild(title);
  const stats = document.createElement('div');
  stats.className = 'gpu-stats small';
  if (points.length) {
    const avg = points.reduce((s, p) => s + Number(p.sm_util), 0) / points.length;
    const peakMemory = Math.max(...points.map((p) => Number(p.mem_used_bytes)));
    stats.textContent = `SM avg ${avg.toFixed(0)}% · memory peak ${formatValue(peakMemory, 'bytes')}`;
  } else {
    stats.textContent = 'no GPU use in this range';
  }
  item.appendChild(stats);
  const canvas = document.createElement('canvas');
  canvas.className = 'gpu-chart';
  canvas.setAttribute('role', 'img');
  canvas.setAttribute('aria-label', `${service.name}: SM utilization over the selected range`);
  item.appendChild(canvas);
  const max = Math.max(100, ...points.map((p) => Number(p.sm_util)));
  drawLineChart(
    canvas,
    [{ points: points.map((p) => ({ t: Number(p.t), v: Number(p.sm_util) })), color: '#e8590c' }],
    { from, until, max, fill: true, height: 56 },
  );
  return item;
}

// ---- health panel ----

function formatUptime(seconds) {
  const s = Number(seconds) || 0;
  if (s < 120) return `${s} s`;
  if (s < 7200) return `${Math.floor(s / 60)} min`;
  if (s < 172800) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  return `${Math.floor(s / 86400)} d`;
}

async function loadHealth() {
  const panel = $('health-panel');
  let health;
  try {
    health = await (await request('/api/health')).json();
  } catch (err) {
    panel.dataset.status = 'unreachable';
    $('health-status').textContent = `unreachable (${err.message})`;
    return;
  }
  const samples = health.samples ?? {};
  const processed = Number(samples.processed ?? 0);
  const dropped = Number(samples.dropped ?? 0);
  const errors = Number(health.errors ?? 0);
  const received = Number(samples.received ?? 0);
  panel.dataset.status = health.status ?? 'ok';
  panel.dataset.samples = String(processed);
  panel.dataset.dropped = String(dropped);
  panel.dataset.errors = String(errors);
  $('health-status').textContent = `${health.status ?? 'ok'}, up ${formatUptime(health.uptime_seconds)}`;
  const rows = [
    ['Samples processed', processed.toLocaleString(), 'samples'],
    ['Samples received', received.toLocaleString(), ''],
    [
      'Samples dropped',
      `${dropped.toLocaleString()}${received + dropped > 0 ? ` (${formatPercent(dropped, received + dropped)})` : ''}`,
      dropped > 0 ? 'warn' : '',
    ],
    ['Errors', errors.toLocaleString(), errors > 0 ? 'warn' : ''],
    ['Profiles written', Number(health.profiles_written ?? 0).toLocaleString(), ''],
  ];
  if (health.store?.enabled) {
    rows.push(['Stored series', Number(health.store.series ?? 0).toLocaleString(), '']);
    rows.push(['Stored size', formatValue(Number(health.store.bytes ?? 0), 'bytes'), '']);
  } else {
    rows.push(['Store', 'off', '']);
  }
  rows.push(['HTTP errors', `${Number(health.http?.errors ?? 0)} of ${Number(health.http?.requests ?? 0)} requests`, '']);
  const list = $('health-list');
  list.textContent = '';
  for (const [label, value, cls] of rows) {
    const dt = document.createElement('dt');
    dt.textContent = label;
    const dd = document.createElement('dd');
    dd.textContent = value;
    if (cls) dd.className = cls;
    list.append(dt, dd);
  }
}

// ---- wiring ----

function wire() {
  const presets = $('presets');
  for (const [name] of PRESETS) {
    const button = document.createElement('button');
    button.type = 'button';
    button.textContent = name;
    button.dataset.preset = name;
    button.setAttribute('aria-pressed', String(state.preset === name));
    button.addEventListener('click', () => {
      state.preset = name;
      markPreset();
      refresh();
    });
    presets.appendChild(button);
  }
  $('custom-apply').addEventListener('click', () => {
    try {
      const { from, until } = readRangeInputs($('custom-from'), $('custom-until'));
      state.preset = '';
      state.from = from;
      state.until = until;
      $('custom-error').textContent = '';
      $('custom-range').open = false;
      markPreset();
      writeHash();
      refresh();
    } catch (err) {
      $('custom-error').textContent = err.message;
    }
  });
  $('custom-range').addEventListener('toggle', () => {
    const { from, until } = currentRange();
    $('custom-from').value = toLocalInput(from);
    $('custom-until').value = toLocalInput(until);
  });
  $('service').addEventListener('change', (e) => selectService(e.target.value));
  $('service-filter').addEventListener('input', () => fillServiceOptions());
  $('filter-name').addEventListener('change', (e) =>
    loadLabelValues(e.target.value).catch((err) => setStatus(err.message, true)),
  );
  $('sandwich-close').addEventListener('click', () => closeSandwich());
  $('group-by').addEventListener('change', (e) => {
    state.groupBy = e.target.value;
    writeHash();
    loadFlamegraph(true);
  });
  $('filter-add').addEventListener('click', () => {
    const name = $('filter-name').value;
    const value = $('filter-value').value;
    if (!name || value === '') return;
    state.filters.push({ name, value });
    filtersChanged();
  });
  $('profile-type').addEventListener('change', (e) => {
    state.profileType = e.target.value;
    writeHash();
    state.mode === 'compare' ? runCompare() : loadFlamegraph();
  });
  $('refresh').addEventListener('click', () => refresh(true));
  let searchTimer;
  $('search').addEventListener('input', (e) => {
    clearTimeout(searchTimer);
    searchTimer = setTimeout(() => setSearch(e.target.value), 120);
  });
  $('reset-zoom').addEventListener('click', () => view.reset());
  for (const tab of document.querySelectorAll('[role=tab]')) {
    tab.addEventListener('click', () => setMode(tab.dataset.mode));
  }
  $('run-compare').addEventListener('click', () => runCompare());
  let liveTimer;
  $('live').addEventListener('change', (e) => {
    clearInterval(liveTimer);
    if (e.target.checked) liveTimer = setInterval(() => state.preset && refresh(true), LIVE_EVERY_MS);
  });
  // Drag across the timeline to select that range (a click alone does nothing).
  const timeline = $('timeline');
  let brushFrom = null;
  const brushX = (e) => {
    const box = timeline.getBoundingClientRect();
    return Math.min(Math.max(e.clientX - box.left, 0), box.width);
  };
  const showBrush = (a, b) => {
    const brush = $('brush');
    brush.hidden = false;
    brush.style.left = `${Math.min(a, b)}px`;
    brush.style.width = `${Math.abs(b - a)}px`;
  };
  timeline.addEventListener('mousedown', (e) => {
    if (state.mode !== 'single') return;
    brushFrom = brushX(e);
    showBrush(brushFrom, brushFrom);
    e.preventDefault();
  });
  window.addEventListener('mousemove', (e) => {
    if (brushFrom !== null) showBrush(brushFrom, brushX(e));
  });
  window.addEventListener('mouseup', (e) => {
    if (brushFrom === null) return;
    const [a, b] = [brushFrom, brushX(e)].sort((x, y) => x - y);
    brushFrom = null;
    $('brush').hidden = true;
    if (b - a < 4) return;
    const { from, until } = state.timelineRange ?? currentRange();
    const width = timeline.getBoundingClientRect().width || 1;
    const at = (x) => Math.round(from + (x / width) * (until - from));
    state.preset = '';
    state.from = at(a);
    state.until = at(b);
    markPreset();
    writeHash();
    refresh();
  });
  for (const button of $('views-toggle').querySelectorAll('button')) {
    button.addEventListener('click', () => {
      state.view = button.dataset.view;
      showView();
      writeHash();
    });
  }
  // Charts are drawn for the width they had: draw them again when it changes.
  let resizeTimer;
  window.addEventListener('resize', () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => refresh(true), 200);
  });
  window.addEventListener('hashchange', () => {
    readHash();
    markPreset();
    if (state.hashMode !== state.mode || state.hashCompare) showMode(state.hashMode);
    refresh(true);
  });
}

/** Shows the flame graph, the table or both (the flame view redraws for its new width). */
function showView() {
  $('views').dataset.view = state.view;
  for (const button of $('views-toggle').querySelectorAll('button')) {
    button.setAttribute('aria-pressed', String(button.dataset.view === state.view));
  }
}

function markPreset() {
  for (const button of $('presets').querySelectorAll('button')) {
    button.setAttribute('aria-pressed', String(button.dataset.preset === state.preset));
  }
  $('custom-range').classList.toggle('active', !state.preset);
}

function main() {
  hideTokenFromAddressBar();
  readHash();
  view = new FlameView($('flame'), $('tooltip'), $('flame-frames'), onViewChange);
  $('search').value = state.search;
  view.setSearch(state.search);
  wire();
  markPreset();
  showView();
  if (state.hashMode === 'compare') showMode('compare');
  refresh();
  loadHealth();
  setInterval(loadHealth, HEALTH_EVERY_MS);
}

main();
