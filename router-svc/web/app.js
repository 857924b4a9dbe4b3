// The load-balance page: polls router-svc's JSON API and draws the per-expert loads of the
// current window; Rebalance and Roll back call the admin API with the token typed here.
'use strict';

const $ = (id) => document.getElementById(id);
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

function drawBars(el, loads, q, sorted) {
  const values = sorted ? [...loads].sort((a, b) => b - a) : loads;
  const max = Math.max(q * 1.2, ...values, 1);
  el.textContent = '';
  values.forEach((v, i) => {
    const b = document.createElement('div');
    b.className = 'bar' + (v > 1.25 * q ? ' hot' : '');
    b.style.height = `${(100 * v / max).toFixed(2)}%`;
    b.title = sorted ? `${v} tokens` : `expert ${i}: ${v} tokens`;
    el.appendChild(b);
  });
  const line = document.createElement('div');
  line.className = 'target';
  line.style.bottom = `calc(4px + ${(100 * q / max).toFixed(2)}% * (152 / 160))`;
  el.appendChild(line);
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
  drawBars($('bars-id'), s.loads, s.target, false);
  drawBars($('bars-sorted'), s.loads, s.target, true);
  const total = s.shards.reduce((a, x) => a + x.load, 0) || 1;
  $('shards').tBodies[0].innerHTML = s.shards.map((x) =>
    `<tr><td>${x.name}</td><td>[${x.lo}, ${x.hi})</td><td>${x.load}</td>` +
    `<td>${(100 * x.load / total).toFixed(1)}%</td><td>${x.healthy ? 'healthy' : 'UNHEALTHY'}</td><td>${x.data_plane}</td></tr>`).join('');
  $('history').tBodies[0].innerHTML = s.history.slice().reverse().map((h) =>
    `<tr><td>${h.version}</td><td>${h.reason}</td><td>${new Date(h.created_unix_ms).toLocaleTimeString()}</td></tr>`).join('');
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
  }
}

$('rebalance').addEventListener('click', () => admin(`/api/rebalance?layer=${layer}`, (r) =>
  `Applied bias version ${r.version} from ${r.window_tokens} tokens: MaxVio ${r.before_max_vio.toFixed(3)} ` +
  `before, ${r.predicted_max_vio.toFixed(3)} predicted at fixed cutoffs; new traffic fills a fresh window.`));
$('rollback').addEventListener('click', () => admin(
  `/api/rollback?layer=${layer}&to=${encodeURIComponent($('rollback-version').value)}`,
  (r) => `Bias version ${r.version} now serves version ${$('rollback-version').value}'s bias.`));
$('layer').addEventListener('change', () => { layer = $('layer').value; refresh(); });

(async function start() {
  try {
    const info = await api('/api/layers');
    $('layer').innerHTML = info.layers.map((l) => `<option value="${l}">${l}</option>`).join('');
    layer = String(info.layers[0]);
    await refresh();
  } catch (e) {
    showMessage(`Cannot reach router-svc: ${e.message}`, 'error');
  }
  setInterval(refresh, 500);
})();
