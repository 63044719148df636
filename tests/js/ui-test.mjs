// End-to-end test of the web UI in headless Chromium (Debian's /usr/bin/chromium driven by
// playwright-core), against a running `profiler agent` that profiles tests/fixtures/ui_workload.c.
// Started by tests/tests/ui.rs with one JSON argument:
//   {url, token, workloadPid, service, otherService,
//    functions: {main, phaseOne, phaseTwo, leaf, other}, screenshots}
// The agent runs with --auth-token: scripts send it as a bearer token, the browser logs in once
// through /?token=… and then carries it in the cookie the server sets.
// Prints what it checked; exits 1 with the reason on the first failed check.
import assert from 'node:assert/strict';
import { mkdirSync } from 'node:fs';
import { join } from 'node:path';
import { gunzipSync } from 'node:zlib';

import { chromium } from 'playwright-core';
import { Profile } from 'pprof-format';

import { decodeFlamegraph, serviceSelector, topFunctions } from '../../profiler-user/ui/flamegraph.mjs';

const config = JSON.parse(process.argv[2] ?? '{}');
const { url, token, workloadPid, service, otherService, functions, screenshots } = config;
const auth = { Authorization: `Bearer ${token}` };
const SAMPLES_TYPE = 'process_cpu:samples:count:cpu:nanoseconds';
// Enough samples (at 100 Hz) that each phase spans several 2-second intervals.
const PHASE_SAMPLES = 300;
// Start-up of a debug agent on a busy 2-core machine varies a lot; these only bound a hang.
const WAIT_MS = 120_000;
const UI_TIMEOUT_MS = 30_000;

const log = (message) => process.stdout.write(`ui-test: ${message}\n`);

async function rpc(method, body) {
  const response = await fetch(`${url}/querier.v1.QuerierService/${method}`, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json', ...auth },
    body: JSON.stringify(body),
  });
  if (!response.ok) throw new Error(`${method}: ${response.status} ${await response.text()}`);
  return response.json();
}

/** Samples of `fn` (total, all stacks) in the service between two times (ms). */
async function samplesOf(fn, from, until) {
  const merge = await rpc('SelectMergeStacktraces', {
    profileTypeID: SAMPLES_TYPE,
    labelSelector: serviceSelector(service),
    start: String(from),
    end: String(until),
  });
  const row = topFunctions(decodeFlamegraph(merge.flamegraph)).find((r) => r.name === fn);
  return row?.total ?? 0;
}

async function waitFor(what, check) {
  const deadline = Date.now() + WAIT_MS;
  let last;
  while (Date.now() < deadline) {
    try {
      last = await check();
      if (last) return last;
    } catch (err) {
      last = err.message;
    }
    await new Promise((resolve) => setTimeout(resolve, 500));
  }
  throw new Error(`gave up waiting for ${what} (last: ${last})`);
}

/** A `datetime-local` value (local time, whole seconds) for `ms`. */
function localInput(ms) {
  const d = new Date(ms);
  const pad = (n) => String(n).padStart(2, '0');
  return (
    `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())}` +
    `T${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`
  );
}

/** Painted pixels of a canvas: how many, how many distinct colours, how many red/green/blue. */
function canvasPixels(page, selector) {
  return page.evaluate((sel) => {
    const canvas = document.querySelector(sel);
    const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
    let painted = 0;
    let red = 0;
    let green = 0;
    let blue = 0;
    const colours = new Set();
    for (let i = 0; i < data.length; i += 4) {
      if (data[i + 3] === 0) continue;
      painted++;
      colours.add((data[i] << 16) | (data[i + 1] << 8) | data[i + 2]);
      if (data[i] > data[i + 1] + 60 && data[i] > data[i + 2] + 60) red++;
      if (data[i + 1] > data[i] + 40 && data[i + 1] > data[i + 2] + 20) green++;
      if (data[i + 2] > data[i] + 40 && data[i + 2] > data[i + 1] + 10) blue++;
    }
    return { painted, pixels: data.length / 4, colours: colours.size, red, green, blue };
  }, selector);
}

/** The drawn frames (hidden list the view keeps in sync with the canvas). */
function frames(page) {
  return page.$$eval('#flame-frames li', (items) =>
    items.map((li) => ({
      name: li.dataset.name,
      depth: Number(li.dataset.depth),
      total: Number(li.dataset.total),
      x: Number(li.dataset.x),
      y: Number(li.dataset.y),
      width: Number(li.dataset.width),
      matched: li.dataset.matched === 'true',
    })),
  );
}

/**
 * The box of an element scrolled fully into the viewport. The pointer moves in viewport
 * coordinates and never scrolls, and clicks elsewhere (a table row, the sandwich view) can
 * leave the page scrolled so that part of the element is above or below the viewport.
 */
async function boxInView(page, selector) {
  const element = await page.$(selector);
  await element.scrollIntoViewIfNeeded();
  return element.boundingBox();
}

/** Visible rows of the top table: name and each numeric cell's value. */
function tableRows(page) {
  return page.$$eval('#top-table tbody tr:not([hidden])', (rows) =>
    rows.map((tr) => ({
      name: tr.dataset.name,
      values: [...tr.cells].slice(1).map((td) => Number(td.dataset.value)),
    })),
  );
}

async function shot(page, name) {
  const path = join(screenshots, `${name}.png`);
  await page.screenshot({ path, fullPage: false });
  log(`screenshot ${path}`);
}

async function prepareData() {
  const firstSeen = await waitFor(`${functions.phaseOne} samples in ${service}`, async () => {
    const now = Date.now();
    const services = (await rpc('LabelValues', { name: 'service_name', start: String(now - 3600e3), end: String(now) })).names ?? [];
    if (!services.includes(service)) return false;
    return (await samplesOf(functions.phaseOne, now - 3600e3, now)) >= PHASE_SAMPLES;
  });
  log(`phase one stored (${firstSeen})`);
  const switchedAt = Date.now();
  process.kill(workloadPid, 'SIGUSR1');
  // Profiles are stamped with the start of their interval; a margin keeps the boundary
  // interval (which holds both phases) out of the comparison range.
  const comparisonFrom = Math.ceil((switchedAt + 1000) / 1000) * 1000;
  await waitFor(`${functions.phaseTwo} samples after the switch`, async () =>
    (await samplesOf(functions.phaseTwo, comparisonFrom, Date.now())) >= PHASE_SAMPLES,
  );
  log('phase two stored');
  return { baseFrom: switchedAt - 3600e3, baseUntil: Math.floor(switchedAt / 1000) * 1000, comparisonFrom };
}

async function main() {
  mkdirSync(screenshots, { recursive: true });
  const ranges = await prepareData();
  const browser = await chromium.launch({
    executablePath: '/usr/bin/chromium',
    args: [
      '--no-sandbox',
      '--disable-gpu',
      '--disable-quic',
      '--no-first-run',
      '--disable-background-networking',
      '--disable-component-update',
      '--disable-sync',
    ],
  });
  const problems = [];
  try {
    const page = await browser.newPage({ viewport: { width: 1440, height: 900 } });
    page.setDefaultTimeout(UI_TIMEOUT_MS);
    page.on('pageerror', (err) => problems.push(`page error: ${err.message}`));
    // The page asks for no favicon (a 404 on every load counted as an HTTP error before).
    page.on('request', (request) => {
      if (new URL(request.url()).pathname === '/favicon.ico') problems.push('favicon requested');
    });
    page.on('console', (msg) => {
      // Refused requests (the 401s before login, a missing /api/gpu) are checked where they happen.
      if (msg.type() === 'error' && !msg.text().startsWith('Failed to load resource')) {
        problems.push(`console: ${msg.text()}`);
      }
    });

    // ---- log in with the token, load, pick the service ----
    const refused = await page.goto(`${url}/`);
    assert.equal(refused.status(), 401, 'without the token the page is refused');
    assert.equal((await page.goto(`${url}/?token=wrong`)).status(), 401, 'a wrong token is refused');
    const login = await page.goto(`${url}/?token=${encodeURIComponent(token)}`);
    assert.equal(login.status(), 200);
    assert.ok(!page.url().includes('token'), `the token left the address bar: ${page.url()}`);
    await page.waitForFunction(() => Number(document.querySelector('#service').dataset.count) >= 2);
    const options = await page.$$eval('#service option', (opts) => opts.map((o) => o.value));
    assert.ok(options.includes(service) && options.includes(otherService), `services offered: ${options}`);
    // The profile types load after the services: wait for the picker to be filled (with the
    // types, or with its "no profiles" entry) before reading it.
    await page.waitForFunction(() => document.querySelector('#profile-type').options.length > 0);
    const types = await page.$$eval('#profile-type option', (opts) => opts.map((o) => o.value));
    assert.ok(types.includes('process_cpu:cpu:nanoseconds:cpu:nanoseconds'), `profile types: ${types}`);
    // The last 5 minutes hold all of this run's data, so the timeline shows it.
    await page.click('#presets button[data-preset="5m"]');
    await page.waitForFunction((done) => document.querySelector('#status').dataset.done === done, `single:${options[0]}:5m`);
    assert.match(page.url(), /range=5m/);
    await page.selectOption('#service', otherService);
    await page.waitForSelector(`#flame-frames li[data-name="${functions.other}"]`, { state: 'attached' });
    await page.selectOption('#service', service);
    await page.waitForSelector(`#flame-frames li[data-name="${functions.main}"]`, { state: 'attached' });
    let drawn = await frames(page);
    assert.ok(!drawn.some((f) => f.name === functions.other), 'the other service\'s frames are gone');
    for (const fn of [functions.phaseOne, functions.phaseTwo, functions.leaf]) {
      assert.ok(drawn.some((f) => f.name === fn), `${fn} is drawn: ${drawn.map((f) => f.name)}`);
    }

    // Services by CPU: both test services, busiest first, the busiest the default; a click
    // selects one. The filter box narrows the picker.
    await page.waitForSelector('#services-panel:not([hidden]) .service-row');
    const overview = await page.$$eval('#service-overview .service-row', (rows) =>
      rows.map((r) => ({ name: r.dataset.service, share: Number(r.dataset.share) })),
    );
    assert.ok(overview.some((r) => r.name === service) && overview.some((r) => r.name === otherService), JSON.stringify(overview));
    for (let i = 1; i < overview.length; i++) assert.ok(overview[i - 1].share >= overview[i].share, `busiest first: ${JSON.stringify(overview)}`);
    assert.equal(options[0], overview[0].name, 'the busiest service comes first in the picker');
    await page.click(`#service-overview .service-row[data-service="${otherService}"]`);
    await page.waitForSelector(`#flame-frames li[data-name="${functions.other}"]`, { state: 'attached' });
    assert.equal(await page.$eval('#service', (el) => el.value), otherService);
    await page.fill('#service-filter', otherService.slice(-4));
    const filtered = await page.$$eval('#service option', (opts) => opts.map((o) => o.value));
    assert.ok(filtered.includes(otherService) && filtered.every((o) => o.includes(otherService.slice(-4))), `filtered: ${filtered}`);
    await page.fill('#service-filter', '');

    // Wall view: the other service sleeps 9 ms in every 10 (the agent runs with --off-cpu), so
    // it has off-CPU profiles, and the picker offers its wall-clock view: its CPU frames and,
    // beside them, the stack it sleeps at, down to the kernel's nanosleep.
    const WALL = 'wall:wall:nanoseconds:wall:nanoseconds';
    const wallDeadline = Date.now() + 60_000;
    for (;;) {
      await page.selectOption('#service', service);
      await page.waitForSelector(`#flame-frames li[data-name="${functions.main}"]`, { state: 'attached' });
      await page.selectOption('#service', otherService);
      await page.waitForSelector(`#flame-frames li[data-name="${functions.other}"]`, { state: 'attached' });
      const offered = await page.$$eval('#profile-type option', (opts) => opts.map((o) => [o.value, o.textContent]));
      const wall = offered.find(([value]) => value === WALL);
      if (wall) {
        assert.match(wall[1], /on-CPU \+ off-CPU/, `the wall option's label: ${wall[1]}`);
        break;
      }
      assert.ok(Date.now() < wallDeadline, `no wall view for ${otherService} after 60 s: ${JSON.stringify(offered)}`);
      await page.waitForTimeout(2000);
    }
    await page.selectOption('#profile-type', WALL);
    await page.waitForSelector('#flame-frames li[data-name="do_nanosleep"]', { state: 'attached' });
    const wallFrames = await frames(page);
    assert.ok(wallFrames.some((f) => f.name === functions.other), `CPU frames in the wall view: ${wallFrames.map((f) => f.name)}`);
    assert.match(page.url(), /type=wall/);
    log(`wall view of ${otherService}: ${wallFrames.length} frames, its sleep included`);
    await page.selectOption('#profile-type', 'process_cpu:cpu:nanoseconds:cpu:nanoseconds');
    await page.selectOption('#service', service);
    await page.waitForSelector(`#flame-frames li[data-name="${functions.main}"]`, { state: 'attached' });
    // Label filter: a label of the service's own series (the agent's: host, executable...)
    // narrows every query; it goes into the URL and comes off with its chip.
    await page.waitForFunction(() => document.querySelector('#filter-name').options.length > 1);
    const labelNames = await page.$$eval('#filter-name option', (opts) => opts.map((o) => o.value).filter(Boolean));
    assert.ok(!labelNames.includes('service_name') && !labelNames.some((n) => n.startsWith('__')), `label names: ${labelNames}`);
    const filterName = labelNames.includes('executable') ? 'executable' : labelNames[0];
    await page.selectOption('#filter-name', filterName);
    await page.waitForFunction(() => !document.querySelector('#filter-add').disabled);
    const filterValue = await page.$eval('#filter-value', (el) => el.value);
    const filterQueries = [];
    const onFilterRequest = (req) => {
      if (req.url().includes('SelectMergeStacktraces')) filterQueries.push(req.postData() ?? '');
    };
    page.on('request', onFilterRequest);
    await page.click('#filter-add');
    await page.waitForSelector(`#filters .chip[data-name="${filterName}"]`);
    await page.waitForFunction(() => location.hash.includes('filter='));
    await page.waitForSelector(`#flame-frames li[data-name="${functions.main}"]`, { state: 'attached' });
    await page.waitForFunction(() => document.querySelector('#status').dataset.done !== undefined);
    page.off('request', onFilterRequest);
    assert.ok(
      filterQueries.some((body) => JSON.parse(body).labelSelector.includes(`${filterName}=`)),
      `the flame graph query carries the filter: ${filterQueries}`,
    );
    assert.ok(decodeURIComponent(page.url()).includes(`filter=${filterName}=${filterValue}`), page.url());
    await page.click(`#filters .chip[data-name="${filterName}"]`);
    await page.waitForFunction(() => !location.hash.includes('filter='));
    assert.equal(await page.$$eval('#filters .chip', (chips) => chips.length), 0);
    log(`label filter ${filterName}=${filterValue}: applied and removed`);

    // Group-by: the timeline splits into one line per value of a label (with a legend); a
    // legend entry filters by its value.
    await page.selectOption('#group-by', filterName);
    await page.waitForFunction(() => Number(document.querySelector('#timeline').dataset.groups) > 0);
    await page.waitForSelector('#group-legend:not([hidden]) button');
    assert.match(page.url(), new RegExp(`group=${filterName}`));
    const legend = await page.$$eval('#group-legend button', (items) => items.map((b) => b.dataset.value));
    assert.ok(legend.includes(filterValue), `legend of ${filterName}: ${legend}`);
    const groupedTimeline = await canvasPixels(page, '#timeline');
    assert.ok(groupedTimeline.painted > 0, `grouped timeline drawn: ${JSON.stringify(groupedTimeline)}`);
    await page.click(`#group-legend button[data-value="${filterValue}"]`);
    await page.waitForSelector(`#filters .chip[data-name="${filterName}"]`);
    await page.click(`#filters .chip[data-name="${filterName}"]`);
    await page.waitForFunction(() => !location.hash.includes('filter='));
    await page.selectOption('#group-by', '');
    await page.waitForFunction(() => document.querySelector('#timeline').dataset.groups === '0');
    assert.ok(!page.url().includes('group='), page.url());
    log(`group by ${filterName}: ${legend.length} line(s); a legend entry filters by its value`);
    log(`services by CPU: ${overview.map((r) => `${r.name} ${(100 * r.share).toFixed(0)}%`).join(', ')}`);
    assert.match(page.url(), new RegExp(`service=${service}`));
    const pixels = await canvasPixels(page, '#flame canvas');
    assert.ok(pixels.painted > 0.2 * pixels.pixels && pixels.colours >= 4, `flame graph is painted: ${JSON.stringify(pixels)}`);
    log(`flame graph of ${service}: ${drawn.length} frames, ${JSON.stringify(pixels)}`);
    await page.waitForFunction(() => Number(document.querySelector('#timeline').dataset.points) > 0);
    const timeline = await canvasPixels(page, '#timeline');
    assert.ok(timeline.red > 0, `the timeline has bars: ${JSON.stringify(timeline)}`);
    await shot(page, 'flamegraph');

    // ---- sandwich: the callers and callees of one function ----
    await page.click(`#top-table tbody tr[data-name="${functions.phaseOne}"] .sandwich-button`);
    await page.waitForSelector('#sandwich:not([hidden])');
    await page.waitForSelector(`#sandwich-callers-frames li[data-name="${functions.main}"]`, { state: 'attached' });
    await page.waitForSelector(`#sandwich-callees-frames li[data-name="${functions.leaf}"]`, { state: 'attached' });
    const calleeNames = await page.$$eval('#sandwich-callees-frames li', (items) => items.map((li) => li.dataset.name));
    assert.ok(!calleeNames.includes(functions.main), `the callees do not hold the caller: ${calleeNames}`);
    assert.equal(await page.textContent('#sandwich-name'), functions.phaseOne);
    assert.match(page.url(), new RegExp(`sandwich=${functions.phaseOne}`));
    const sandwichPixels = await canvasPixels(page, '#sandwich-callers canvas');
    assert.ok(sandwichPixels.painted > 0, `the callers graph is drawn: ${JSON.stringify(sandwichPixels)}`);
    await shot(page, 'sandwich');
    await page.click('#sandwich-close');
    await page.waitForSelector('#sandwich', { state: 'hidden' });
    assert.ok(!page.url().includes('sandwich='), page.url());
    log(`sandwich of ${functions.phaseOne}: callers up to ${functions.main}, callees down to ${functions.leaf}`);

    // ---- hover ----
    // The flame graph is redrawn whenever a query finishes (the filter and group-by above
    // reload it, and "last 5 minutes" then holds newer samples), so the frames are read
    // again just before the pointer moves; a redraw between reading and moving is retried.
    let leaf;
    let canvasBox;
    for (let attempt = 1; ; attempt++) {
      drawn = await frames(page);
      leaf = drawn.find((f) => f.name === functions.leaf);
      canvasBox = await boxInView(page, '#flame canvas');
      await page.mouse.move(canvasBox.x + leaf.x + leaf.width / 2, canvasBox.y + leaf.y + 9);
      try {
        await page.waitForSelector('#tooltip:not([hidden])', { timeout: 5000 });
        break;
      } catch (error) {
        if (attempt === 3) throw new Error(`no tooltip over ${JSON.stringify(leaf)} in ${JSON.stringify(canvasBox)}: ${error.message}`);
        await page.mouse.move(0, 0);
      }
    }
    const tip = await page.textContent('#tooltip');
    assert.ok(tip.includes(functions.leaf) && /Total.*%/.test(tip) && /Self/.test(tip), `tooltip: ${tip}`);
    log(`tooltip: ${tip}`);

    // ---- click to zoom, reset ----
    const target = drawn.find((f) => f.name === functions.phaseOne);
    await page.mouse.click(canvasBox.x + target.x + target.width / 2, canvasBox.y + target.y + 9);
    await page.waitForSelector(`#flame canvas[data-focus="${functions.phaseOne}"]`);
    drawn = await frames(page);
    const zoomed = drawn.find((f) => f.name === functions.phaseOne);
    assert.ok(target.width < canvasBox.width * 0.95, `the frame was not already full width: ${target.width}`);
    assert.ok(zoomed.x === 0 && Math.abs(zoomed.width - canvasBox.width) < 2, `zoomed frame spans the width: ${JSON.stringify(zoomed)}`);
    assert.deepEqual(drawn.filter((f) => f.depth === target.depth).map((f) => f.name), [functions.phaseOne], 'its siblings are hidden');
    assert.ok(drawn.some((f) => f.name === functions.main && f.depth < target.depth), 'its callers stay above it');
    assert.ok(drawn.some((f) => f.name === functions.leaf && f.depth > target.depth && f.width > canvasBox.width / 2), 'its callee is scaled up');
    assert.ok((await page.textContent('#breadcrumb')).includes(functions.phaseOne));
    await page.mouse.move(canvasBox.x + canvasBox.width / 2, canvasBox.y + zoomed.y + 9 + 18);
    await page.waitForSelector('#tooltip:not([hidden])');
    assert.match(await page.textContent('#tooltip'), /Of zoomed frame/);
    await shot(page, 'zoom');
    await page.click('#reset-zoom');
    await page.waitForSelector('#flame canvas[data-focus=""]');
    log('zoom and reset work');

    // ---- search ----
    await page.fill('#search', 'ui_fixture_parse');
    await page.waitForFunction(() => Number(document.querySelector('#search-status').dataset.matches) > 0);
    const percent = Number(await page.getAttribute('#search-status', 'data-percent'));
    drawn = await frames(page);
    const matched = drawn.filter((f) => f.matched);
    assert.ok(matched.length > 0 && matched.every((f) => f.name.includes('ui_fixture_parse')), 'only matching frames are marked');
    const rootTotal = drawn.find((f) => f.depth === 0).total;
    const expected = (100 * matched.reduce((sum, f) => sum + f.total, 0)) / rootTotal;
    assert.ok(percent > 0 && percent < 100 && Math.abs(percent - expected) < 0.5, `search covers ${percent}% (frames say ${expected}%)`);
    assert.match(await page.textContent('#search-status'), /%/);
    const searchPixels = await page.evaluate(() => {
      const c = document.querySelector('#flame canvas');
      const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
      let purple = 0;
      for (let i = 0; i < d.length; i += 4) if (d[i + 2] > d[i + 1] + 60 && d[i] > d[i + 1] + 30) purple++;
      return purple;
    });
    assert.ok(searchPixels > 0, 'matches are highlighted on the canvas');
    let rows = await tableRows(page);
    assert.ok(rows.length > 0 && rows.every((r) => r.name.includes('ui_fixture_parse')), `table follows the search: ${rows.map((r) => r.name)}`);
    log(`search matches ${matched.length} frames, ${percent.toFixed(2)}%`);
    await shot(page, 'search');
    await page.fill('#search', '');
    await page.waitForFunction(() => document.querySelector('#search-status').dataset.matches === '0');

    // ---- top table ----
    rows = await tableRows(page);
    assert.equal(rows[0].name, functions.leaf, `the hot leaf tops the self column: ${rows.slice(0, 5).map((r) => r.name)}`);
    const descending = (values) => values.every((v, i) => i === 0 || values[i - 1] >= v);
    assert.ok(descending(rows.map((r) => r.values[0])), 'sorted by self, descending');
    await page.click('#top-table th button[data-sort="total"]');
    rows = await tableRows(page);
    assert.ok(descending(rows.map((r) => r.values[1])), 'sorted by total, descending');
    await page.click('#top-table th button[data-sort="total"]');
    rows = await tableRows(page);
    assert.ok(descending(rows.map((r) => -r.values[1])), 'sorted by total, ascending');
    await page.click('#top-table th button[data-sort="self"]');
    log(`top table: ${rows.length} functions, sorting works`);

    // ---- pprof download ----
    const href = await page.getAttribute('#download', 'href');
    assert.ok(href.startsWith('/api/pprof?'), href);
    // Fetched by the page itself, so with the cookie as a click on the link would be.
    const download = Buffer.from(
      await page.evaluate(async (link) => {
        const response = await fetch(link, { credentials: 'same-origin' });
        return [...new Uint8Array(await response.arrayBuffer())];
      }, href),
    );
    assert.ok(download[0] === 0x1f && download[1] === 0x8b, 'the download is gzipped');
    const profile = Profile.decode(gunzipSync(download));
    const strings = profile.stringTable.strings;
    assert.ok(strings.includes(functions.main), 'the pprof holds the fixture function');
    log(`pprof download: ${download.length} bytes, ${profile.sample.length} samples`);

    // ---- health ----
    await page.waitForFunction(() => Number(document.querySelector('#health-panel').dataset.samples) > 0);
    const health = await page.textContent('#health-panel');
    assert.match(health, /Samples processed/);
    assert.match(health, /Samples dropped/);
    assert.match(health, /Errors/);
    log(`health: ${await page.getAttribute('#health-panel', 'data-samples')} samples`);

    // ---- GPU panel: what this agent serves, then stand-ins for absent GPU hardware ----
    const gpuResponse = await fetch(`${url}/api/gpu?from=${Date.now() - 3600e3}&until=${Date.now()}`, {
      headers: auth,
    });
    const gpuHidden = () => page.$eval('#gpu-panel', (el) => el.hidden);
    if (gpuResponse.status === 404) {
      assert.ok(await gpuHidden(), 'no /api/gpu: the panel is hidden');
      log('GPU: /api/gpu not served, panel hidden');
    } else {
      const body = await gpuResponse.json();
      await page.waitForFunction((available) => document.querySelector('#gpu-panel').hidden !== available, body.available);
      if (!body.available) {
        assert.ok((await page.textContent('#gpu-note')).includes(body.reason ?? ''), 'the reason is shown');
      }
      log(`GPU: available=${body.available} reason=${body.reason}`);
    }
    const now = Date.now();
    const points = (offset) =>
      Array.from({ length: 60 }, (_, i) => ({
        t: now - 3600e3 + i * 60e3,
        util: Math.round(50 + 45 * Math.sin(i / 6 + offset)),
        mem_util: Math.round(30 + 20 * Math.cos(i / 9 + offset)),
        mem_used_bytes: 20 * 2 ** 30,
        mem_total_bytes: 80 * 2 ** 30,
      }));
    // The selected service is asked for by name; its own GPU use is drawn first.
    const askedServices = [];
    await page.route('**/api/gpu?*', (route) => {
      const service = new URL(route.request().url()).searchParams.get('service');
      askedServices.push(service);
      route.fulfill({
        contentType: 'application/json',
        body: JSON.stringify({
          available: true,
          reason: null,
          gpus: [0, 1].map((index) => ({ index, uuid: `GPU-standin-${index}`, name: 'Stand-in H100', points: points(index) })),
          // The overview's summary: every service with GPU use in the range.
          services: service ? [{ name: service, sm_util: 63.4, max_mem_used_bytes: 12 * 2 ** 30 }] : [],
          ...(service
            ? {
                service: {
                  name: service,
                  points: points(0).map((p) => ({ t: p.t, sm_util: p.util, mem_used_bytes: 12 * 2 ** 30 })),
                },
              }
            : {}),
        }),
      });
    });
    await page.click('#refresh');
    await page.waitForFunction(() => document.querySelectorAll('#gpu-list .gpu').length === 3);
    const selectedService = await page.$eval('#service', (el) => el.value);
    assert.ok(selectedService, 'a service is selected');
    assert.equal(askedServices.at(-1), selectedService, `asked for ${JSON.stringify(askedServices)}`);
    assert.equal(await page.$eval('#gpu-list .gpu-service', (el) => el.dataset.service), selectedService);
    assert.match(
      await page.textContent('#gpu-list .gpu-service'),
      /on the GPUs.*SM avg \d+% · memory peak 12\.0 GiB/,
    );
    assert.ok(!(await gpuHidden()));
    // The services overview shows the selected service's GPU use beside its CPU share.
    await page.waitForFunction(
      (name) => document.querySelector(`#service-overview .service-row[data-service="${name}"]`)?.dataset.gpuSm === '63.4',
      selectedService,
    );
    assert.match(
      await page.textContent(`#service-overview .service-row[data-service="${selectedService}"]`),
      /· GPU SM 63%, 12\.0 GiB/,
    );
    assert.equal(await page.textContent('#services-title'), 'Services by CPU (and GPU)');
    const gpuPixels = await canvasPixels(page, '#gpu-list .gpu:not(.gpu-service) canvas');
    assert.ok(gpuPixels.green > 0, `utilization line drawn: ${JSON.stringify(gpuPixels)}`);
    assert.match(await page.textContent('#gpu-list'), /util avg \d+%, peak \d+% · memory 20\.0 GiB \/ 80\.0 GiB/);
    await shot(page, 'gpu-standin');
    await page.unroute('**/api/gpu?*');
    await page.route('**/api/gpu?*', (route) =>
      route.fulfill({ contentType: 'application/json', body: JSON.stringify({ available: false, reason: 'NVML not found', gpus: [] }) }),
    );
    await page.click('#refresh');
    await page.waitForFunction(() => document.querySelector('#gpu-panel').hidden);
    await page.waitForFunction(() => document.querySelector('#gpu-note').textContent.includes('NVML not found'));
    // No GPU use known: the overview says nothing of GPUs.
    await page.waitForFunction(() => document.querySelector('#services-title').textContent === 'Services by CPU');
    assert.equal(await page.$$eval('#service-overview .service-row[data-gpu-sm]', (rows) => rows.length), 0);
    await page.unroute('**/api/gpu?*');
    await page.route('**/api/gpu?*', (route) => route.fulfill({ status: 404, contentType: 'application/json', body: '{}' }));
    await page.click('#refresh');
    await page.waitForFunction(() => document.querySelector('#gpu-panel').hidden && document.querySelector('#gpu-note').hidden);
    await page.unroute('**/api/gpu?*');
    log('GPU panel: shown with data, hidden with a reason, hidden on 404');

    // ---- compare ----
    await page.click('[role=tab][data-mode=compare]');
    await page.waitForSelector('#compare-controls:not([hidden])');
    await page.fill('#base-from', localInput(ranges.baseFrom));
    await page.fill('#base-until', localInput(ranges.baseUntil));
    await page.fill('#comp-from', localInput(ranges.comparisonFrom));
    const comparisonUntil = Date.now() + 60e3;
    await page.fill('#comp-until', localInput(comparisonUntil));
    await page.click('#run-compare');
    const second = (ms) => Math.floor(ms / 1000) * 1000;
    const expectedRun = `compare:${service}:${second(ranges.baseFrom)}-${second(ranges.baseUntil)}:${second(ranges.comparisonFrom)}-${second(comparisonUntil)}`;
    await page.waitForFunction((done) => document.querySelector('#status').dataset.done === done, expectedRun);
    assert.equal(await page.getAttribute('#flame canvas', 'data-mode'), 'diff');
    await page.waitForSelector(`#top-table tbody tr[data-name="${functions.phaseTwo}"]`);
    const leftTicks = Number(await page.getAttribute('#flame canvas', 'data-left-ticks'));
    const rightTicks = Number(await page.getAttribute('#flame canvas', 'data-right-ticks'));
    assert.ok(leftTicks > 0 && rightTicks > 0, `both sides have data: ${leftTicks} ${rightTicks}`);
    rows = await tableRows(page);
    // Diff columns: baseline self, comparison self, self change, baseline total, comparison
    // total, total change.
    const share = (name) => {
      const row = rows.find((r) => r.name === name);
      assert.ok(row, `${name} in the diff table`);
      const change = row.values[4] / rightTicks - row.values[3] / leftTicks;
      assert.ok(Math.abs(change - row.values[5]) < 1e-9, `the table's change of ${name}: ${row.values[5]} vs ${change}`);
      return change;
    };
    assert.equal(rows[0].name, functions.phaseTwo, 'the largest growth comes first');
    assert.ok(share(functions.phaseTwo) > 0.2, `${functions.phaseTwo} grew: ${share(functions.phaseTwo)}`);
    assert.ok(share(functions.phaseOne) < -0.2, `${functions.phaseOne} shrank: ${share(functions.phaseOne)}`);
    const diffPixels = await canvasPixels(page, '#flame canvas');
    // Red for more, blue for less (a colour-blind-safe pair), never green.
    assert.ok(diffPixels.red > 0 && diffPixels.blue > 0 && diffPixels.green === 0, `diff colours: ${JSON.stringify(diffPixels)}`);
    const grown = (await frames(page)).find((f) => f.name === functions.phaseTwo);
    const diffBox = await boxInView(page, '#flame canvas');
    await page.mouse.move(diffBox.x + grown.x + grown.width / 2, diffBox.y + grown.y + 9);
    await page.waitForSelector('#tooltip:not([hidden])');
    assert.match(await page.textContent('#tooltip'), /Baseline.*Comparison/s);
    log(`compare: ${functions.phaseTwo} +${(100 * share(functions.phaseTwo)).toFixed(1)} pts, ${functions.phaseOne} ${(100 * share(functions.phaseOne)).toFixed(1)} pts`);
    await shot(page, 'compare');

    // The comparison is in the URL: a reload (or a shared link) shows the same one.
    const hash = new URLSearchParams(new URL(page.url()).hash.slice(1));
    assert.equal(hash.get('mode'), 'compare', page.url());
    assert.equal(Number(hash.get('base_from')), second(ranges.baseFrom), page.url());
    assert.equal(Number(hash.get('comp_until')), second(comparisonUntil), page.url());
    await page.reload();
    await page.waitForSelector('#compare-controls:not([hidden])');
    await page.waitForFunction((done) => document.querySelector('#status').dataset.done === done, expectedRun);
    assert.equal(await page.getAttribute('#flame canvas', 'data-mode'), 'diff');
    log('compare: restored from the URL after a reload');

    // Any two selections: this service's whole run against the other service's.
    await page.fill('#base-from', localInput(ranges.baseFrom));
    await page.fill('#base-until', localInput(comparisonUntil));
    await page.fill('#comp-from', localInput(ranges.baseFrom));
    await page.fill('#comp-until', localInput(comparisonUntil));
    await page.selectOption('#comp-service', otherService);
    await page.click('#run-compare');
    const acrossRun = `compare:${service}:${second(ranges.baseFrom)}-${second(comparisonUntil)}:${second(ranges.baseFrom)}-${second(comparisonUntil)}:vs:${otherService}`;
    await page.waitForFunction((done) => document.querySelector('#status').dataset.done === done, acrossRun);
    await page.waitForSelector(`#top-table tbody tr[data-name="${functions.other}"]`);
    rows = await tableRows(page);
    const acrossRight = Number(await page.getAttribute('#flame canvas', 'data-right-ticks'));
    const acrossLeft = Number(await page.getAttribute('#flame canvas', 'data-left-ticks'));
    const otherRow = rows.find((r) => r.name === functions.other);
    const mainRow = rows.find((r) => r.name === functions.phaseOne);
    assert.ok(otherRow.values[4] > 0 && otherRow.values[3] === 0, `only the comparison runs ${functions.other}: ${JSON.stringify(otherRow)}`);
    assert.ok(mainRow.values[3] > 0 && mainRow.values[4] === 0, `only the baseline runs ${functions.phaseOne}: ${JSON.stringify(mainRow)}`);
    assert.ok(acrossLeft > 0 && acrossRight > 0);
    assert.equal(new URLSearchParams(new URL(page.url()).hash.slice(1)).get('comp_service'), otherService);
    await page.selectOption('#comp-service', '');
    log(`compare across services: ${service} vs ${otherService}`);

    // Default compare ranges: two halves of equal length, to the second.
    await page.click('[role=tab][data-mode=single]');
    await page.click('[role=tab][data-mode=compare]');
    const lengths = await page.evaluate(() => {
      const ms = (id) => new Date(document.getElementById(id).value).getTime();
      return [ms('base-until') - ms('base-from'), ms('comp-until') - ms('comp-from'), ms('comp-from') - ms('base-until')];
    });
    assert.ok(lengths[0] > 0 && lengths[0] === lengths[1] && lengths[2] === 0, `default halves: ${lengths}`);

    // A custom range closes its popover once applied.
    await page.click('[role=tab][data-mode=single]');
    await page.click('#custom-range summary');
    await page.waitForFunction(() => document.querySelector('#custom-range').open);
    await page.fill('#custom-from', localInput(Date.now() - 10 * 60e3));
    await page.fill('#custom-until', localInput(Date.now() + 60e3));
    await page.click('#custom-apply');
    await page.waitForFunction(() => !document.querySelector('#custom-range').open);
    await page.waitForFunction(() => /from=\d+&until=\d+/.test(location.hash) && !location.hash.includes('range='));
    log('custom range: applied, popover closed');

    // Flame graph and table side by side by default; either alone with the toggle (in the URL).
    const shown = (selector) => page.$eval(selector, (el) => getComputedStyle(el).display !== 'none');
    const flameBox = await (await page.$('#flame')).boundingBox();
    const tableBox = await (await page.$('.top')).boundingBox();
    assert.ok(flameBox.x + flameBox.width <= tableBox.x + 1, `side by side: ${JSON.stringify([flameBox, tableBox])}`);
    await page.click('#views-toggle [data-view=table]');
    assert.ok(!(await shown('#flame')) && (await shown('.top')), 'the table alone');
    assert.match(page.url(), /view=table/);
    await page.click('#views-toggle [data-view=flame]');
    assert.ok((await shown('#flame')) && !(await shown('.top')), 'the flame graph alone');
    await page.click('#views-toggle [data-view=both]');
    assert.ok((await shown('#flame')) && (await shown('.top')));
    log('views: both side by side, table alone, flame graph alone');

    // Dragging across the timeline selects that part of the range.
    await page.click('#presets button[data-preset="5m"]');
    await page.waitForFunction((done) => document.querySelector('#status').dataset.done === done, `single:${service}:5m`);
    const timelineBox = await boxInView(page, '#timeline');
    const y = timelineBox.y + timelineBox.height / 2;
    await page.mouse.move(timelineBox.x + timelineBox.width * 0.4, y);
    await page.mouse.down();
    await page.mouse.move(timelineBox.x + timelineBox.width * 0.6, y, { steps: 5 });
    await page.mouse.up();
    await page.waitForFunction(() => /from=\d+&until=\d+/.test(location.hash));
    const brushed = new URLSearchParams(new URL(page.url()).hash.slice(1));
    const brushedSpan = Number(brushed.get('until')) - Number(brushed.get('from'));
    assert.ok(brushedSpan > 0.15 * 300e3 && brushedSpan < 0.25 * 300e3, `a fifth of 5 minutes: ${brushedSpan} ms`);
    log(`timeline brush: selected ${Math.round(brushedSpan / 1000)} s`);

    assert.deepEqual(problems, [], 'no errors in the page');
  } finally {
    await browser.close();
  }
  log('all checks passed');
}

main().catch((err) => {
  process.stderr.write(`ui-test failed: ${err.stack ?? err}\n`);
  process.exit(1);
});
