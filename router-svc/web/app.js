// The load-balance page: polls router-svc's JSON API and draws the per-expert loads of the
// current window; Rebalance and Roll back call the admin API with the token typed here.
'use strict';

const $ = (id) => document.getElementById(id);
// Text a member reported, made safe to put inside HTML.
const esc = (v) => String(v).replace(/[&<>"']/g, (c) => ({'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;'}[c]));
let layer = null;
let busy = false;

function showMessage(text, kind) {
  const m = $('message');
  m.textContent = text;
  m.className = kind;
}

async function api(path, options) {
  const r = await fetch(path, options);
  let body = null;
  try { body = await r.json(); } catch (e) { body = { error: `HTTP ${r.status} without a JSON body` }; }
  if (!r.ok) throw new Error(body && body.error ? body.error : `HTTP ${r.status}`);
  return body;
}

// The loads of the last window before the latest Rebalance (the "ghost" marks): the bars then
// move from them toward the even line as new windows fill.
let ghost = null;
let lastVersion = null;
let lastLoads = null;
const timeline = [];  // {t, vio, floor, version}, at most TIMELINE_POINTS
const TIMELINE_POINTS = 240;

// Bars are kept and resized (not rebuilt), so a new window's heights animate from the old ones.
function drawBars(el, loads, q, sorted, axisMax, ghostLoads) {
  const order = loads.map((v, i) => i);
  if (sorted) order.sort((a, b) => loads[b] - loads[a]);
  const max = Math.max(q * 1.2, ...loads, ...(ghostLoads || []), 1);
  let line = el.querySelector(':scope > .target');
  if (line === null) {
    line = document.createElement('div');
    line.className = 'target';
    el.appendChild(line);
  }
  const barsOf = () => Array.from(el.children).filter((c) => c !== line);
  while (barsOf().length > loads.length) el.removeChild(barsOf()[0]);
  while (barsOf().length < loads.length) el.insertBefore(document.createElement('div'), line);
  const bars = barsOf();
  order.forEach((e, i) => {
    const b = bars[i];
    const v = loads[e];
    b.className = 'bar' + (v > 1.25 * q ? ' hot' : '');
    b.style.height = `${(100 * v / max).toFixed(2)}%`;
    b.title = `expert ${e}: ${v} tokens`;
    b.dataset.expert = String(e);
    b.textContent = '';
    if (ghostLoads) {  // where this expert's bar stood before the Rebalance, relative to the bar
      const g = document.createElement('div');
      g.className = 'ghost';
      g.style.bottom = v > 0 ? `${(100 * ghostLoads[e] / v).toFixed(2)}%` : '0';
      b.appendChild(g);
    }
  });
  line.style.bottom = `calc(4px + ${(100 * q / max).toFixed(2)}% * (152 / 160))`;
  $(axisMax).textContent = Math.round(max).toLocaleString();
}

function drawTimeline() {
  const svg = $('vio-chart');
  const max = Math.max(0.1, ...timeline.map((p) => Math.max(p.vio, p.floor))) * 1.1;
  const x = (i) => (timeline.length < 2 ? 0 : (1000 * i) / (timeline.length - 1)).toFixed(1);
  const y = (v) => (160 - (160 * v) / max).toFixed(1);
  const points = timeline.map((p, i) => `${x(i)},${y(p.vio)}`).join(' ');
  const floor = timeline.map((p, i) => `${x(i)},${y(p.floor)}`).join(' ');
  const versions = timeline.map((p, i) => (i > 0 && p.version !== timeline[i - 1].version
    ? `<line class="version" x1="${x(i)}" x2="${x(i)}" y1="0" y2="160"><title>bias version ${p.version}</title></line>` : ''));
  svg.innerHTML = `<polyline class="floor" points="${floor}"></polyline>` +
                  `<polyline class="vio" points="${points}"></polyline>` + versions.join('');
  svg.dataset.points = String(timeline.length);
  $('y-max-vio').textContent = max.toFixed(2);
  $('vio-since').textContent = timeline.length ? new Date(timeline[0].t).toLocaleTimeString() : '';
}

function drawBudget() {
  const svg = $('budget-chart');
  const pts = timeline.filter((p) => p.k);
  const max = pts.length ? pts[pts.length - 1].k : 1;
  const x = (i) => (pts.length < 2 ? 0 : (1000 * i) / (pts.length - 1)).toFixed(1);
  const y = (v) => (160 - (150 * v) / max).toFixed(1);
  const served = pts.map((p, i) => `${x(i)},${y(p.served)}`).join(' ');
  const kavg = pts.map((p, i) => `${x(i)},${y(p.kavg)}`).join(' ');
  const steps = pts.map((p, i) => (i > 0 && p.served !== pts[i - 1].served
    ? `<line class="version" x1="${x(i)}" x2="${x(i)}" y1="0" y2="160"><title>served ${p.served}</title></line>` : ''));
  svg.innerHTML = `<polyline class="kavg" points="${kavg}"></polyline>` +
                  `<polyline class="served" points="${served}"></polyline>` + steps.join('');
  svg.dataset.points = String(pts.length);
  $('y-max-budget').textContent = String(max);
  $('budget-since').textContent = pts.length ? new Date(pts[0].t).toLocaleTimeString() : '';
}

function render(s) {
  const vio = s.window_tokens > 0 ? s.max_vio : null;
  const mv = $('maxvio');
  mv.textContent = vio === null ? '–' : vio.toFixed(3);
  mv.dataset.value = vio === null ? '' : String(vio);
  mv.className = 'value ' + (vio === null ? '' : vio > 0.5 ? 'bad' : 'good');
  $('noise-floor').textContent = s.noise_floor.toFixed(3);
  $('window-tokens').textContent = s.window_tokens.toLocaleString();
  $('bias-version').textContent = s.bias_version;
  $('mode').textContent = s.mode;
  $('rebalances').textContent = s.rebalances;
  $('shard-ratio').textContent = s.shard_max_over_mean ? s.shard_max_over_mean.toFixed(3) : '–';
  $('cv').textContent = s.cv.toFixed(3);
  $('dead').textContent = s.dead;
  const b = s.budget;
  $('expert-budget').textContent = `${b.k_avg} of ${b.k}`;
  $('expert-budget').dataset.value = String(b.k_avg);
  $('budget-served').textContent = b.solved ? `${b.served} per token (k_min ${b.k_min}; thresholds from ${b.solved_from_tokens.toLocaleString()} tokens)`
    : `${b.k} per token (no thresholds solved yet: set a budget after traffic)`;
  $('budget-served').dataset.value = String(b.served);
  $('budget-cost').textContent = b.checks > 0
    ? `${b.mean_rel_diff.toFixed(3)} relative output difference vs full k; ${(100 * b.mean_mass_kept).toFixed(1)}% of the routing weight kept; top-1 of a stand-in LM head the same for ${(100 * b.mean_top1_agreement).toFixed(1)}% of tokens (mean of ${b.checks} sampled checks, this version)`
    : 'no full-k checks yet in this version';
  $('budget-cost').dataset.value = b.checks > 0 ? String(b.mean_rel_diff) : '';
  $('budget-k').max = String(b.k);
  if (lastVersion !== null && s.bias_version !== lastVersion && lastLoads !== null) {
    ghost = lastLoads;  // a new bias: remember where the bars were
  }
  if (s.window_tokens > 0) {
    lastVersion = s.bias_version;
    lastLoads = s.loads;
    timeline.push({ t: Date.now(), vio: s.max_vio, floor: s.noise_floor, version: s.bias_version,
                    served: s.budget.served, kavg: s.budget.k_avg, k: s.budget.k });
    if (timeline.length > TIMELINE_POINTS) timeline.shift();
  }
  const g = ghost && ghost.length === s.loads.length ? ghost : null;
  drawBars($('bars-id'), s.loads, s.target, false, 'y-max-id', g);
  drawBars($('bars-sorted'), s.loads, s.target, true, 'y-max-sorted', g);
  $('x-max-id').textContent = `expert ${s.loads.length - 1}`;
  drawTimeline();
  drawBudget();
  const total = s.shards.reduce((a, x) => a + x.load, 0) || 1;
  $('shards').tBodies[0].innerHTML = s.shards.map((x) =>
    `<tr><td>${esc(x.name)}</td><td>[${x.lo}, ${x.hi})</td><td>${x.load}</td>` +
    `<td>${(100 * x.load / total).toFixed(1)}%</td><td>${x.quarantined ? 'QUARANTINED (wrong answers)' : x.healthy ? 'healthy' : 'UNHEALTHY'}</td><td class="lanes">${esc(x.data_plane)}${x.lanes ? ' · ' + esc(x.lanes) : ''}</td></tr>`).join('');
  // Each attention node's readiness canary (a fixed batch through the whole path against its
  // in-process reference) and twin audits (replicas compared), as the node last reported them.
  $('nodes').tBodies[0].innerHTML = (s.nodes || []).map((n) => {
    const canary = n.canary === 'off' || n.canary === 'pending' ? n.canary :
      `${n.canary_ready ? 'ready' : 'NOT READY'} (${esc(n.canary)}, ${(n.canary_age_ms / 1000).toFixed(0)} s ago)`;
    const a = n.audits;
    return `<tr><td>${esc(n.node)}</td><td class="canary">${canary}</td>` +
      `<td class="audits">${a.agree} agree, ${a.within_bound} within bound, ${a.caught} caught, ${a.unresolved} unresolved, ${a.skipped} skipped</td>` +
      `<td>${n.quarantined.map(esc).join(', ') || '-'}</td><td>${(n.seen_ms_ago / 1000).toFixed(1)} s ago</td></tr>`;
  }).join('');
  $('history').tBodies[0].innerHTML = s.history.slice().reverse().map((h) =>
    `<tr><td>${h.version}</td><td>${esc(h.reason)}</td><td>${new Date(h.created_unix_ms).toLocaleTimeString()}</td></tr>`).join('');
}

async function refresh() {
  if (layer === null) return;
  try {
    render(await api(`/api/state?layer=${layer}`));
    $('status').textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (e) {
    $('status').textContent = 'not updating';
    showMessage(`Cannot read the load statistics: ${e.message}`, 'error');
  }
}

async function admin(path, what) {
  if (busy) return;
  busy = true;
  $('rebalance').disabled = true;
  $('rollback').disabled = true;
  $('set-budget').disabled = true;
  try {
    const r = await api(path, { method: 'POST', headers: { 'X-Moe-Admin-Token': $('token').value } });
    showMessage(what(r), 'ok');
    await refresh();
  } catch (e) {
    showMessage(`Refused: ${e.message}`, 'error');
  } finally {
    busy = false;
    $('rebalance').disabled = false;
    $('rollback').disabled = false;
    $('set-budget').disabled = false;
  }
}

$('rebalance').addEventListener('click', () => admin(`/api/rebalance?layer=${layer}`, (r) =>
  `Applied bias version ${r.version} from ${r.window_tokens} tokens: MaxVio ${r.before_max_vio.toFixed(3)} ` +
  `before, ${r.predicted_max_vio.toFixed(3)} predicted at fixed cutoffs; new traffic fills a fresh window.`));
$('rollback').addEventListener('click', () => admin(
  `/api/rollback?layer=${layer}&to=${encodeURIComponent($('rollback-version').value)}`,
  (r) => `Bias version ${r.version} now serves version ${$('rollback-version').value}'s bias.`));
$('set-budget').addEventListener('click', () => admin(
  `/api/budget?layer=${layer}&k_avg=${encodeURIComponent($('budget-k').value)}`,
  (r) => `Expert budget ${r.k_avg} per token as bias version ${r.version} (${r.reason}).`));
$('layer').addEventListener('change', () => { layer = $('layer').value; refresh(); });

(async function start() {
  try {
    const info = await api('/api/layers');
    // How the router's state began at this start: a new (initialized) state is said loudly.
    const st = info.state || {};
    const since = st.initialized_unix_ms ? new Date(st.initialized_unix_ms).toISOString() : '';
    $('state-origin').textContent = st.start === 'initialized'
      ? `state: NEW at this start (${st.store}, --initialize, ${since}): bias history begins here`
      : st.start === 'in_memory' ? 'state: in memory (lost when router-svc restarts)'
        : `state: ${st.store}, restored (since ${since})`;
    $('state-origin').className = st.start === 'restored' ? 'muted' : 'warn';
    $('layer').innerHTML = info.layers.map((l) => `<option value="${l}">${l}</option>`).join('');
    layer = String(info.layers[0]);
    await refresh();
  } catch (e) {
    showMessage(`Cannot reach router-svc: ${e.message}`, 'error');
  }
  setInterval(refresh, 500);
})();
