// Browser test of router-svc's load-balance page: a real local cluster under skewed traffic,
// Debian's headless Chromium driven by playwright-core.
//   1. open the page, read the imbalance figure once the window holds enough tokens: above 1.0;
//   2. click Rebalance without the token: refused on the page, the bias version stays 0;
//   3. type the token, click Rebalance: version 1 applied; traffic keeps flowing;
//   4. the figure, on a fresh window of enough tokens, falls below 0.3.
// Screenshots before and after go to --artifacts (not committed). Every wait is bounded.
//
//   node page_test.mjs --moe-cli build/bin/moe-cli --moe-tool build/services/moe-tool \
//        --work /tmp/pagetest --artifacts build/tests/web-artifacts
import http from 'node:http';
import { spawn, spawnSync } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import { chromium } from 'playwright-core';

const THRESHOLD_BEFORE = 1.0;  // skewed traffic on the mid preset: MaxVio ~1.6
const THRESHOLD_AFTER = 0.3;   // one QB step: ~0.15-0.2 (noise floor ~0.14 at 8000 tokens)
const MIN_WINDOW_TOKENS = 8000;
const TOKEN = 'page-test-token';

function arg(name) {
  const i = process.argv.indexOf(`--${name}`);
  if (i < 0 || i + 1 >= process.argv.length) throw new Error(`missing --${name}`);
  return process.argv[i + 1];
}

function sleep(ms) { return new Promise((r) => setTimeout(r, ms)); }

async function waitFor(what, fn, seconds) {
  const until = Date.now() + seconds * 1000;
  let last;
  while (Date.now() < until) {
    try {
      const v = await fn();
      if (v) return v;
    } catch (e) { last = e; }
    await sleep(250);
  }
  throw new Error(`timed out after ${seconds} s waiting for ${what}${last ? `: ${last}` : ''}`);
}

function assert(cond, message) {
  if (!cond) throw new Error(message);
}

const cli = arg('moe-cli');
const tool = arg('moe-tool');
const work = arg('work');
const artifacts = arg('artifacts');
fs.mkdirSync(work, { recursive: true });
fs.mkdirSync(artifacts, { recursive: true });
const ckpt = path.join(work, 'ckpt-mid');
if (!fs.existsSync(path.join(ckpt, 'config.json'))) {
  const r = spawnSync(tool, ['synth', '--config', 'mid', '--out', ckpt, '--seed', '1', '--skew', '1.0'],
                      { stdio: 'ignore', timeout: 300000 });
  assert(r.status === 0, 'moe-tool synth failed');
}
const clusterDir = path.join(work, 'cluster');
// A fresh cluster: moe-cli up keeps the router's state in the work dir across runs.
for (const stale of ['cluster.json', 'router.db', 'router.db-wal', 'router.db-shm']) {
  fs.rmSync(path.join(clusterDir, stale), { force: true });
}

const children = [];
let browser = null;
function stopAll() {
  for (const c of children.reverse()) {
    if (c.exitCode === null) c.kill('SIGTERM');
  }
}
process.on('exit', stopAll);

try {
  // The admin token in a file only this user reads (tokens never go on a command line).
  const tokenFile = path.join(work, 'admin_token');
  fs.writeFileSync(tokenFile, TOKEN, { mode: 0o600 });
  const up = spawn(cli, ['up', '--checkpoint', ckpt, '--work_dir', clusterDir, '--admin_token_file', tokenFile,
                         '--threads', '1', '--max_seconds', '600',
                         '--attention_args', '--report_interval_ms=200'], { stdio: 'ignore' });
  children.push(up);
  const clusterJson = path.join(clusterDir, 'cluster.json');
  await waitFor('cluster.json', () => fs.existsSync(clusterJson), 120);
  const cluster = JSON.parse(fs.readFileSync(clusterJson, 'utf8'));
  const url = `http://${cluster.web}/`;

  // Traffic that keeps flowing through the whole test (bounded: 240 s).
  const load = spawn(cli, ['loadgen', '--cluster', clusterJson, '--checkpoint', ckpt,
                           '--duration', '240', '--concurrency', '2', '--tokens', '64',
                           '--batches', '64', '--seed', '9'], { stdio: 'ignore' });
  children.push(load);

  browser = await chromium.launch({
    executablePath: '/usr/bin/chromium',
    args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
           '--disable-background-networking', '--disable-component-update', '--disable-sync'],
  });
  const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
  const consoleErrors = [];
  page.on('pageerror', (e) => consoleErrors.push(String(e)));
  await page.goto(url);

  // The three in one turn of the page's script: read one by one, a render between them paired a
  // full window with the MaxVio of the page before its first render (NaN, seen once in CI).
  const read = async () => page.evaluate(() => ({
    vio: parseFloat(document.getElementById('maxvio').dataset.value),
    window: parseInt(document.getElementById('window-tokens').textContent.replace(/[^0-9]/g, ''), 10),
    version: document.getElementById('bias-version').textContent.trim(),
  }));

  const before = await waitFor('a full window before Rebalance', async () => {
    const s = await read();
    return s.window >= MIN_WINDOW_TOKENS ? s : null;
  }, 90);
  console.log(`before: MaxVio ${before.vio.toFixed(3)} over ${before.window} tokens, bias version ${before.version}`);
  assert(before.vio > THRESHOLD_BEFORE, `expected MaxVio above ${THRESHOLD_BEFORE}, read ${before.vio}`);
  // A fresh work dir: moe-cli up made a new router state (--initialize), and the page says so.
  const origin = (await page.textContent('#state-origin')).trim();
  assert(/^state: NEW at this start \(sqlite, --initialize, /.test(origin), `state line: "${origin}"`);

  // The charts say what they show: axis labels with a scale, a legend for every mark, one bar
  // per expert, and the imbalance over time with its noise floor.
  const E = await page.$$eval('#bars-id > .bar', (b) => b.length);
  assert(E === 128, `expected a bar per expert (128), found ${E}`);
  for (const text of ['tokens in the window', 'expert id', 'experts by load', 'MaxVio', 'time']) {
    assert(await page.locator('.y-label, .x-label', { hasText: text }).count() > 0, `no axis label "${text}"`);
  }
  const yMax = parseInt((await page.textContent('#y-max-id')).replace(/[^0-9]/g, ''), 10);
  assert(yMax > 0, `no scale on the y axis (${yMax})`);
  assert((await page.textContent('#x-max-id')).trim() === 'expert 127', 'no last expert id on the x axis');
  const legend = await page.$$eval('#legend .key', (k) => k.map((x) => x.textContent));
  for (const text of ['hot: above 1.25 q', 'the even load q', 'before Rebalance']) {
    assert(legend.some((l) => l.includes(text)), `legend lacks "${text}": ${legend}`);
  }
  const hotColour = await page.$eval('#legend .swatch.hot', (s) => getComputedStyle(s).backgroundColor);
  const hotBar = await page.$eval('#bars-id > .bar.hot', (s) => getComputedStyle(s).backgroundColor);
  assert(hotColour === hotBar, `the legend's hot colour ${hotColour} is not the hot bars' ${hotBar}`);
  const points = await waitFor('MaxVio over time', async () => {
    const n = parseInt(await page.getAttribute('#vio-chart', 'data-points'), 10);
    return n >= 4 ? n : null;
  }, 30);
  assert(await page.$('#vio-chart polyline.vio') && await page.$('#vio-chart polyline.floor'),
         'the timeline lacks the MaxVio line or the noise floor');
  console.log(`charts: ${E} bars, y axis to ${yMax} tokens, legend ${legend.length} keys, timeline ${points} points`);

  // The shard table shows the lanes UCX really selected (heartbeated by each shard, read from
  // UCX), the same the attention node reads on its side of each endpoint (its metrics).
  const lanesCells = await waitFor('the data plane lanes on the page', async () => {
    const cells = await page.$$eval('#shards td.lanes', (t) => t.map((x) => x.textContent));
    return cells.length >= 2 && cells.every((c) => / · /.test(c)) ? cells : null;
  }, 30);
  const metricsText = await new Promise((resolve, reject) => {
    http.get(`http://${cluster.attention_metrics}/metrics`, (res) => {
      let body = '';
      res.on('data', (d) => { body += d; });
      res.on('end', () => resolve(body));
    }).on('error', reject);
  });
  for (const cell of lanesCells) {
    // The shard's first backend (UCX, what it registers), then the lanes of its clients: of one
    // backend as it says them ("shm (posix)"), of several (--data_plane=auto: UCX and shm) each
    // by name, "ucx (shm (sysv, cma)), shm" or "shm" (a node that opened UCX once, e.g. for a
    // batch while its shm connection was being made, keeps that client).
    const m = /^ucx · (.+)$/.exec(cell);
    assert(m, `the data plane cell "${cell}" does not name the shard's first backend, UCX`);
    const named = /^(?:ucx \((.+)\))?(?:, )?(shm)?$/.exec(m[1]);
    const lanes = named && (named[1] || named[2]) ? [named[1], named[2]].filter(Boolean) : [m[1]];
    for (const l of lanes) {
      assert(/^(shm|tcp|rdma|mixed)/.test(l), `the data plane cell "${cell}" has no lanes in "${l}"`);
    }
    // The attention node's view of the shard: the lanes of the connection it opened last.
    assert(lanes.some((l) => metricsText.includes(`shard_lanes="${l}"`)),
           `the page's lanes "${m[1]}" are not what the attention node read (${lanes.join(' | ')})`);
  }
  console.log(`data plane: ${lanesCells.join('; ')}`);

  // The attention node's readiness canary on the page, as its own metrics say it: ready after a
  // match (the cluster was started ready, so its first canary matched); its twin audits' row.
  const canaryCell = await waitFor('the attention node\'s canary on the page', async () => {
    const cells = await page.$$eval('#nodes td.canary', (t) => t.map((x) => x.textContent));
    return cells.length === 1 && /^ready \(match, \d+ s ago\)$/.test(cells[0]) ? cells[0] : null;
  }, 30);
  assert(/^moe_canary_ready 1(\.0)?$/m.test(metricsText), 'the node\'s moe_canary_ready is not 1');
  const audits = await page.$eval('#nodes td.audits', (t) => t.textContent);
  assert(/^\d+ agree, \d+ within bound, 0 caught, 0 unresolved, \d+ skipped$/.test(audits),
         `the twin audits cell reads "${audits}"`);
  console.log(`attention node: canary ${canaryCell}; audits ${audits}`);

  // The mean distance of the bars from the even line, in pixels (the "queue" the toy shows).
  const spread = () => page.$eval('#bars-id', (el) => {
    const line = el.querySelector(':scope > .target').getBoundingClientRect().top;
    const bars = Array.from(el.querySelectorAll(':scope > .bar'));
    return bars.reduce((a, b) => a + Math.abs(b.getBoundingClientRect().top - line), 0) / bars.length;
  });
  const spreadBefore = await spread();
  await page.screenshot({ path: path.join(artifacts, 'before.png'), fullPage: true });

  // Without the token: refused, shown on the page, nothing changes.
  await page.click('#rebalance');
  await waitFor('the refusal on the page', async () =>
    (await page.getAttribute('#message', 'class')) === 'error', 20);
  const refusal = await page.textContent('#message');
  console.log(`without token: "${refusal}"`);
  assert(/admin token is required/.test(refusal), `unexpected message: ${refusal}`);
  assert((await read()).version === '0', 'the bias changed without the token');

  // With the token.
  await page.fill('#token', TOKEN);
  await page.click('#rebalance');
  await waitFor('the applied message', async () =>
    (await page.getAttribute('#message', 'class')) === 'ok', 20);
  console.log(`with token: "${await page.textContent('#message')}"`);
  const after = await waitFor(`MaxVio below ${THRESHOLD_AFTER} on a fresh window`, async () => {
    const s = await read();
    return s.version === '1' && s.window >= MIN_WINDOW_TOKENS && s.vio < THRESHOLD_AFTER ? s : null;
  }, 120);
  console.log(`after: MaxVio ${after.vio.toFixed(3)} over ${after.window} tokens, bias version ${after.version}`);
  // The bars moved toward the even line, the old loads stay as marks, the timeline marks the
  // new bias version.
  const spreadAfter = await spread();
  console.log(`bars from the even line: ${spreadBefore.toFixed(1)} px before, ${spreadAfter.toFixed(1)} px after`);
  assert(spreadAfter < 0.6 * spreadBefore, `the bars did not move toward the even line (${spreadBefore} -> ${spreadAfter})`);
  const ghosts = await page.$$eval('#bars-id .bar .ghost', (g) => g.length);
  assert(ghosts === 128, `expected the pre-Rebalance loads as 128 marks, found ${ghosts}`);
  assert(await page.$('#vio-chart line.version'), 'the timeline does not mark the new bias version');
  await page.screenshot({ path: path.join(artifacts, 'after.png'), fullPage: true });

  // Dynamic k: the layer serves the full top-k; the button sets a budget of 4 (thresholds from
  // the traffic in the window), the figure and the served budget follow, the sampled full-k
  // checks report what it costs, the budget's time line draws it.
  const budgetText = (await page.textContent('#expert-budget')).trim();
  assert(budgetText === '8 of 8', `expected the full top-k "8 of 8", read "${budgetText}"`);
  await page.fill('#budget-k', '4');
  await page.click('#set-budget');
  await waitFor('the budget message', async () =>
    /Expert budget 4 per token/.test(await page.textContent('#message')), 20);
  console.log(`budget: "${await page.textContent('#message')}"`);
  await waitFor('the budget served', async () =>
    (await page.getAttribute('#expert-budget', 'data-value')) === '4' &&
    (await page.getAttribute('#budget-served', 'data-value')) === '4', 20);
  const cost = await waitFor('a measured cost of the budget', async () => {
    const v = await page.getAttribute('#budget-cost', 'data-value');
    return v ? parseFloat(v) : null;
  }, 90);
  console.log(`budget cost: "${await page.textContent('#budget-cost')}"`);
  assert(cost > 0 && cost < 2, `the measured relative difference ${cost} is not a difference`);
  const costText = await page.textContent('#budget-cost');
  assert(/% of the routing weight kept/.test(costText) && /% of tokens/.test(costText),
         `the cost does not say the weight kept and the top-1 agreement: "${costText}"`);
  assert(await page.$('#budget-chart polyline.served') && await page.$('#budget-chart polyline.kavg'),
         'the budget time line is not drawn');
  await page.screenshot({ path: path.join(artifacts, 'budget.png'), fullPage: true });
  assert(consoleErrors.length === 0, `page errors: ${consoleErrors.join('; ')}`);
  console.log(`screenshots: ${path.join(artifacts, 'before.png')}, ${path.join(artifacts, 'after.png')}`);
  console.log('PASS');
} catch (e) {
  console.error(`FAIL: ${e.message}`);
  process.exitCode = 1;
} finally {
  if (browser) await browser.close();
  stopAll();
}
