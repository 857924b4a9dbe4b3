// Validates a rendered moe-serving chart: every object against the Kubernetes schemas
// (kubernetes-models; ServiceMonitor against prometheus-operator's), then the chart's own
// invariants:
//   * the expert shards cover every expert exactly once (ranges.json vs E of config.json, the
//     StatefulSet's replicas and every ordinal);
//   * container ports and probes match the services' flags (--port, --metrics_port,
//     --web_port); Service target ports name existing container ports;
//   * selectors match labels (workloads and Services), the StatefulSet's headless Service;
//   * every container and init container has resource requests and limits;
//   * the router address the others use is the router Service; the admin token comes from a
//     Secret that exists (or is named as existing); the dashboard ConfigMap is the Grafana JSON.
//
//   node validate.mjs --manifests rendered.yaml --dashboard deploy/grafana/moe-dashboard.json
//                     [--expect-admin-secret NAME] [--expect-servicemonitor] [--expect-gpu]
//                     [--expect-ranges ranges.json]  (moe-tool ranges: the placement rule)
//                     [--expect-no-networkpolicy]
import fs from 'node:fs';
import { createRequire } from 'node:module';
import yaml from 'js-yaml';

import { mutationsOf } from './mutations.mjs';
import { checkNetworkPolicies } from './network_policy_checks.mjs';

const require = createRequire(import.meta.url);
const models = {
  'v1/ConfigMap': require('kubernetes-models/v1/ConfigMap').ConfigMap,
  'v1/Secret': require('kubernetes-models/v1/Secret').Secret,
  'v1/Service': require('kubernetes-models/v1/Service').Service,
  'apps/v1/Deployment': require('kubernetes-models/apps/v1/Deployment').Deployment,
  'apps/v1/StatefulSet': require('kubernetes-models/apps/v1/StatefulSet').StatefulSet,
  'policy/v1/PodDisruptionBudget': require('kubernetes-models/policy/v1/PodDisruptionBudget').PodDisruptionBudget,
  'autoscaling/v2/HorizontalPodAutoscaler':
    require('kubernetes-models/autoscaling/v2/HorizontalPodAutoscaler').HorizontalPodAutoscaler,
  'networking.k8s.io/v1/NetworkPolicy':
    require('kubernetes-models/networking.k8s.io/v1/NetworkPolicy').NetworkPolicy,
  'cert-manager.io/v1/Issuer': (await import(
    '@kubernetes-models/cert-manager/cert-manager.io/v1/Issuer')).Issuer,
  'cert-manager.io/v1/Certificate': (await import(
    '@kubernetes-models/cert-manager/cert-manager.io/v1/Certificate')).Certificate,
  'monitoring.coreos.com/v1/ServiceMonitor': (await import(
    '@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor')).ServiceMonitor,
};

function arg(name, fallback) {
  const i = process.argv.indexOf(`--${name}`);
  if (i < 0) return fallback;
  return process.argv[i + 1];
}
const flag = (name) => process.argv.includes(`--${name}`);

const failures = [];
function check(cond, message) { if (!cond) failures.push(message); }

const docs = yaml.loadAll(fs.readFileSync(arg('manifests'), 'utf8')).filter((d) => d);
console.log(`${docs.length} objects`);

// --mutate NAME breaks the manifests on purpose, so the test can show each check failing
// (mutations.mjs).
const mutations = mutationsOf(docs);
const mutation = arg('mutate');
if (mutation) {
  if (!mutations[mutation]) { console.error(`unknown mutation ${mutation}`); process.exit(2); }
  mutations[mutation]();
}

// 1. Schemas.
for (const d of docs) {
  const key = `${d.apiVersion}/${d.kind}`;
  const Model = models[key];
  if (!Model) { failures.push(`no schema for ${key} (${d.metadata?.name})`); continue; }
  try { new Model(d).validate(); } catch (e) { failures.push(`${key} ${d.metadata?.name}: ${e.message}`); }
}

const byKind = (kind) => docs.filter((d) => d.kind === kind);
const workloads = [...byKind('Deployment'), ...byKind('StatefulSet')];
const services = byKind('Service');

function flagValue(args, name) {
  const a = (args || []).find((x) => x.startsWith(`--${name}=`));
  return a === undefined ? undefined : a.slice(name.length + 3);
}
const matches = (selector, labels) =>
  Object.entries(selector || {}).every(([k, v]) => labels && labels[k] === v);

// 2. Expert coverage.
const model = byKind('ConfigMap').find((c) => c.data && c.data['ranges.json']);
check(model, 'no ConfigMap with ranges.json');
if (model) {
  const e = JSON.parse(model.data['config.json']).text_config.num_experts;
  const table = JSON.parse(model.data['ranges.json']);
  check(table.num_experts === e, `ranges.json says E = ${table.num_experts}, config.json ${e}`);
  const owner = new Array(e).fill(0);
  for (const [lo, hi] of table.ranges) for (let x = lo; x < hi; ++x) owner[x] += 1;
  const bad = owner.map((n, x) => [x, n]).filter(([, n]) => n !== 1);
  check(bad.length === 0, `experts not covered exactly once by the ranges: ${JSON.stringify(bad.slice(0, 5))}`);
  // The chart's table is the placement library's rule (moe-tool ranges), not a copy of it.
  const expected = arg('expect-ranges');
  if (expected) {
    const want = JSON.parse(fs.readFileSync(expected, 'utf8'));
    check(table.num_experts === want.num_experts &&
          table.replicas_per_range === want.replicas_per_range &&
          JSON.stringify(table.ranges) === JSON.stringify(want.ranges),
          `ranges.json ${JSON.stringify(table)} != moe-tool ranges ${JSON.stringify(want)}`);
  }
  const sts = byKind('StatefulSet').find((d) => d.metadata.labels['app.kubernetes.io/component'] === 'expert');
  check(sts, 'no expert StatefulSet');
  if (sts) {
    const pods = sts.spec.replicas;
    check(pods === table.ranges.length * table.replicas_per_range,
          `StatefulSet replicas ${pods} != ${table.ranges.length} ranges x ${table.replicas_per_range}`);
    // Every ordinal's range (ordinal / replicas_per_range), pooled: each range served by
    // replicas_per_range pods, so every expert by exactly replicas_per_range pods.
    const served = new Array(e).fill(0);
    for (let o = 0; o < pods; ++o) {
      const r = table.ranges[Math.floor(o / table.replicas_per_range)];
      check(r !== undefined, `ordinal ${o} has no range`);
      if (r) for (let x = r[0]; x < r[1]; ++x) served[x] += 1;
    }
    check(served.every((n) => n === table.replicas_per_range),
          `every expert must be served by ${table.replicas_per_range} pods`);
    const c = sts.spec.template.spec.containers[0];
    check(flagValue(c.args, 'ranges_file') === '/etc/moe/ranges.json', 'expert-svc --ranges_file');
    const mount = c.volumeMounts.find((m) => m.mountPath === '/etc/moe');
    const vol = sts.spec.template.spec.volumes.find((v) => v.name === mount?.name);
    check(vol?.configMap?.name === model.metadata.name, 'ranges.json is not mounted from the model ConfigMap');
    const headless = services.find((s) => s.metadata.name === sts.spec.serviceName);
    check(headless && headless.spec.clusterIP === 'None', 'StatefulSet serviceName is not a headless Service');
    const adv = flagValue(c.args, 'advertise') || '';
    check(adv.includes(`.${sts.spec.serviceName}.`), `--advertise ${adv} is not a pod DNS name under the headless Service`);
    console.log(`experts: E = ${e}, ${table.ranges.length} ranges x ${table.replicas_per_range} = ${pods} pods, every expert once per replica set`);
  }
}

// 3. Ports, probes, resources, selectors.
for (const w of workloads) {
  const name = `${w.kind} ${w.metadata.name}`;
  const tmpl = w.spec.template;
  check(matches(w.spec.selector.matchLabels, tmpl.metadata.labels), `${name}: selector does not match its pod labels`);
  const all = [...(tmpl.spec.initContainers || []), ...tmpl.spec.containers];
  for (const c of all) {
    const r = c.resources || {};
    check(r.requests && r.requests.cpu && r.requests.memory, `${name}/${c.name}: no cpu/memory requests`);
    check(r.limits && r.limits.memory, `${name}/${c.name}: no memory limit`);
  }
  for (const c of tmpl.spec.containers) {
    const ports = Object.fromEntries((c.ports || []).map((p) => [p.name, p.containerPort]));
    const grpc = Number(flagValue(c.args, 'port'));
    check(ports.grpc === grpc, `${name}/${c.name}: container port grpc ${ports.grpc} != --port ${grpc}`);
    const metrics = Number(flagValue(c.args, 'metrics_port'));
    check(ports.metrics === metrics, `${name}/${c.name}: metrics port ${ports.metrics} != --metrics_port ${metrics}`);
    if (flagValue(c.args, 'web_port') !== undefined) {
      check(ports.web === Number(flagValue(c.args, 'web_port')), `${name}/${c.name}: web port != --web_port`);
    }
    check(flagValue(c.args, 'host') === '0.0.0.0', `${name}/${c.name}: must listen on all pod addresses`);
    if (flag('expect-tls')) {  // exec probes over the pod's certificate, on the gRPC port
      for (const p of ['startupProbe', 'livenessProbe', 'readinessProbe']) {
        const cmd = (c[p]?.exec?.command || []).join(' ');
        check(cmd.includes('moe-cli health') && cmd.includes(`--endpoint=127.0.0.1:${grpc}`) &&
              cmd.includes('--tls_cert_file=/var/run/moe/tls/tls.crt'),
              `${name}/${c.name}: ${p} is not a TLS health probe on ${grpc}`);
      }
      check((c.livenessProbe.exec.command.join(' ')).includes('--service=moe.liveness'),
            `${name}/${c.name}: liveness must ask moe.liveness`);
      check(!(c.readinessProbe.exec.command.join(' ')).includes('--service'),
            `${name}/${c.name}: readiness must ask the overall status`);
    } else {
      for (const p of ['startupProbe', 'livenessProbe', 'readinessProbe']) {
        check(c[p] && c[p].grpc && c[p].grpc.port === grpc, `${name}/${c.name}: ${p} is not a gRPC probe on ${grpc}`);
      }
      check(c.livenessProbe?.grpc?.service === 'moe.liveness', `${name}/${c.name}: liveness must ask moe.liveness`);
      check(!c.readinessProbe?.grpc?.service, `${name}/${c.name}: readiness must ask the overall status`);
    }
    const router = flagValue(c.args, 'router');
    if (router !== undefined) {
      const [host, port] = router.split(':');
      const svc = services.find((s) => s.metadata.name === host);
      check(svc && svc.spec.ports.some((p) => p.port === Number(port) && p.name === 'grpc'),
            `${name}/${c.name}: --router ${router} is not the router Service's grpc port`);
      check(svc && matches(svc.spec.selector, workloads.find((x) => x.spec.template.spec.containers[0].name === 'router-svc')?.spec.template.metadata.labels),
            `${name}/${c.name}: --router does not select the router pods`);
    }
    for (const env of c.env || []) {
      const ref = env.valueFrom?.secretKeyRef;
      if (!ref) continue;
      const secret = byKind('Secret').find((s) => s.metadata.name === ref.name);
      const expected = arg('expect-admin-secret');
      check(secret ? secret.data && secret.data[ref.key] : ref.name === expected,
            `${name}/${c.name}: env ${env.name} refers to a missing Secret ${ref.name}/${ref.key}`);
    }
  }
}
for (const s of services) {
  const targets = workloads.filter((w) => matches(s.spec.selector, w.spec.template.metadata.labels));
  check(targets.length === 1, `Service ${s.metadata.name} selects ${targets.length} workloads (want 1)`);
  for (const p of s.spec.ports) {
    const names = targets.flatMap((w) => w.spec.template.spec.containers.flatMap((c) => (c.ports || []).map((x) => x.name)));
    check(names.includes(p.targetPort), `Service ${s.metadata.name} port ${p.name}: no container port named ${p.targetPort}`);
  }
}
// A token flag's file lies on a mounted Secret volume that others cannot read; the Secret exists
// (or is the expected existing one).
function secretFileFor(w, flagName, expectedSecret) {
  const spec = w.spec.template.spec;
  const file = flagValue(spec.containers[0].args, flagName);
  const mount = (spec.containers[0].volumeMounts || [])  // the deepest mount holding the file
    .filter((m) => file && file.startsWith(m.mountPath + '/'))
    .sort((x, y) => y.mountPath.length - x.mountPath.length)[0];
  const vol = mount && (spec.volumes || []).find((v) => v.name === mount.name);
  const name = vol && vol.secret && vol.secret.secretName;
  return {
    ok: Boolean(name) && (name === expectedSecret ||
        byKind('Secret').some((s) => s.metadata.name === name && s.data)),
    private: Boolean(vol && vol.secret) && (vol.secret.defaultMode & 0o004) === 0 &&
             spec.securityContext && spec.securityContext.fsGroup > 0,
  };
}
// Membership: router, attention and expert pods all read the cluster token from the Secret.
for (const w of workloads) {
  const c = w.spec.template.spec.containers[0];
  if (!['router-svc', 'attention-svc', 'expert-svc'].includes(c.name)) continue;
  const f = secretFileFor(w, 'cluster_token_file', arg('expect-cluster-secret'));
  check(f.ok, `${w.metadata.name}: no --cluster_token_file on a mounted Secret`);
  check(f.private, `${w.metadata.name}: the cluster token file is readable beyond the pod's group`);
  check(!c.args.some((a) => /token=/.test(a) && !/token_file=/.test(a)), `${w.metadata.name}: a token on the command line`);
  check(!(c.env || []).some((e) => /TOKEN/.test(e.name)), `${w.metadata.name}: a token in the environment`);
}
// TLS: every service reads certificate, key and CA from the mounted Secret, private to the pod.
if (arg('expect-tls-secret')) {
  for (const w of workloads) {
    const c = w.spec.template.spec.containers[0];
    if (!['router-svc', 'attention-svc', 'expert-svc'].includes(c.name)) continue;
    for (const flagName of ['tls_cert_file', 'tls_key_file', 'tls_ca_file']) {
      const f = secretFileFor(w, flagName, arg('expect-tls-secret'));
      check(f.ok, `${w.metadata.name}: no --${flagName} on the mounted TLS Secret`);
      check(f.private, `${w.metadata.name}: the TLS files are readable beyond the pod's group`);
    }
    check(c.args.includes('--tls_require_client_cert=true'), `${w.metadata.name}: not mutual TLS`);
  }
} else if (!flag('expect-tls')) {
  check(!workloads.some((w) => w.spec.template.spec.containers[0].args.some((a) => a.startsWith('--tls_'))),
        'TLS flags without tls.enabled');
}
const router = workloads.find((w) => w.spec.template.spec.containers[0].name === 'router-svc');
// The control plane's state: router-svc is one StatefulSet pod whose --state_db lies on its
// volume (a claim template unless persistence is off), or several on etcd.
(() => {
  const spec = router.spec.template.spec;
  const db = flagValue(spec.containers[0].args, 'state_db');
  const mount = (spec.containers[0].volumeMounts || []).find((m) => db && db.startsWith(m.mountPath + '/'));
  const etcd = flagValue(spec.containers[0].args, 'etcd');
  if (arg('expect-router-etcd')) {
    check(etcd === arg('expect-router-etcd') && !db && spec.containers[0].args.includes('--name=$(POD_NAME)'),
          `router-svc is not on etcd ${arg('expect-router-etcd')} (--etcd ${etcd}, --state_db ${db})`);
    check(router.spec.replicas > 1, 'several routers expected with etcd');
    return;
  }
  check(router.kind === 'StatefulSet' && router.spec.replicas === 1, 'router-svc is not one StatefulSet pod');
  const claimed = (router.spec.volumeClaimTemplates || []).some((t) => mount && t.metadata.name === mount.name);
  const empty = (spec.volumes || []).some((v) => mount && v.name === mount.name && v.emptyDir);
  check(db && mount && (flag('expect-router-emptydir') ? empty : claimed),
        `router-svc's --state_db ${db} is not on its ${flag('expect-router-emptydir') ? 'emptyDir' : 'claimed volume'}`);
})();
if (arg('expect-admin-secret')) {
  const args = router.spec.template.spec.containers[0].args;
  const f = secretFileFor(router, 'admin_token_file', arg('expect-admin-secret'));
  check(f.ok, 'router-svc does not read its admin token from a mounted Secret');
  check(f.private, 'the admin token file is readable beyond the pod\'s group');
  check(!args.some((a) => a.startsWith('--admin_token=')), 'the admin token is on the command line');
}

// 4. Monitoring objects.
const sm = byKind('ServiceMonitor');
check(flag('expect-servicemonitor') ? sm.length === 1 : sm.length === 0, `ServiceMonitor count ${sm.length}`);
for (const m of sm) {
  for (const ep of m.spec.endpoints) {
    const selected = services.filter((s) => matches(m.spec.selector.matchLabels, s.metadata.labels));
    check(selected.length >= 3 && selected.every((s) => s.spec.ports.some((p) => p.name === ep.port)),
          `ServiceMonitor port ${ep.port} missing on a selected Service`);
  }
}
const dash = byKind('ConfigMap').find((c) => c.data && c.data['moe-dashboard.json']);
check(dash && JSON.stringify(JSON.parse(dash.data['moe-dashboard.json'])) ===
      JSON.stringify(JSON.parse(fs.readFileSync(arg('dashboard'), 'utf8'))),
      'the dashboard ConfigMap differs from deploy/grafana/moe-dashboard.json');
// Imported by the Grafana sidecar (provisioning does not fill in __inputs): every ${VAR} the
// dashboard uses is one of its own template variables, the data source one of type datasource.
{
  const d = JSON.parse(fs.readFileSync(arg('dashboard'), 'utf8'));
  const vars = new Map((d.templating?.list || []).map((v) => [v.name, v.type]));
  const used = new Set([...JSON.stringify(d).matchAll(/\$\{([A-Za-z_][A-Za-z0-9_]*)/g)].map((m) => m[1]));
  for (const u of used) check(vars.has(u), `the dashboard uses \${${u}} but defines no such variable`);
  check(vars.get('DS_PROMETHEUS') === 'datasource', 'the dashboard has no datasource variable DS_PROMETHEUS');
  check(!d.__inputs, 'the dashboard needs __inputs (the sidecar cannot fill them in)');
}
// The data plane: attention and expert containers get the same --data_plane and UCX_TLS, and
// with RDMA the device resource and IPC_LOCK.
if (arg('expect-data-plane')) {
  const pods = [...byKind('Deployment'), ...byKind('StatefulSet')].filter((w) =>
    ['attention', 'expert'].includes(w.metadata.labels['app.kubernetes.io/component']));
  check(pods.length === 2, `found ${pods.length} attention/expert workloads`);
  for (const w of pods) {
    const c = w.spec.template.spec.containers[0];
    const name = w.metadata.name;
    check(c.args.includes(`--data_plane=${arg('expect-data-plane')}`), `${name}: no --data_plane=${arg('expect-data-plane')}`);
    const tls = (c.env || []).find((e) => e.name === 'UCX_TLS');
    check(tls && tls.value === arg('expect-ucx-tls'), `${name}: UCX_TLS is ${tls && tls.value}`);
    const rdma = arg('expect-rdma');
    if (rdma) {
      check(c.resources.limits[rdma] >= 1 && c.resources.requests[rdma] >= 1, `${name}: no ${rdma} resource`);
      check(c.securityContext && c.securityContext.capabilities.add.includes('IPC_LOCK'), `${name}: no IPC_LOCK`);
    } else {
      check(!Object.keys(c.resources.limits || {}).some((k) => k.startsWith('rdma/')), `${name}: an RDMA resource without rdma.enabled`);
    }
  }
}
// Disruptions: one PodDisruptionBudget per range, selecting exactly the pods that serve that
// range (ordinals r*R .. r*R+R-1): minAvailable 1 with replicas, maxUnavailable 1 with one pod
// per range (minAvailable 1 would block every node drain); expert pods spread by anti-affinity.
{
  const sts = byKind('StatefulSet').find((d) => d.metadata.labels['app.kubernetes.io/component'] === 'expert');
  const table = JSON.parse(byKind('ConfigMap').find((c) => c.data && c.data['ranges.json']).data['ranges.json']);
  const R = table.replicas_per_range;
  const pdbs = byKind('PodDisruptionBudget');
  check(pdbs.length === table.ranges.length, `${pdbs.length} PodDisruptionBudgets for ${table.ranges.length} ranges`);
  table.ranges.forEach((range, r) => {
    const want = Array.from({ length: R }, (_, j) => `${sts.metadata.name}-${r * R + j}`);
    const pdb = pdbs.find((p) => {
      const names = p.spec.selector.matchExpressions?.find((e) => e.key === 'statefulset.kubernetes.io/pod-name')?.values || [];
      return JSON.stringify([...names].sort()) === JSON.stringify([...want].sort());
    });
    const budget = R > 1 ? pdb && pdb.spec.minAvailable === 1 && pdb.spec.maxUnavailable === undefined
      : pdb && pdb.spec.maxUnavailable === 1 && pdb.spec.minAvailable === undefined;
    check(pdb && budget && matches(pdb.spec.selector.matchLabels, sts.spec.template.metadata.labels),
          `range ${r} [${range}]: no PodDisruptionBudget ${R > 1 ? 'keeping one' : 'letting a drain evict one'} of ${want.join(', ')}`);
  });
  const anti = sts.spec.template.spec.affinity?.podAntiAffinity?.preferredDuringSchedulingIgnoredDuringExecution;
  check(anti && anti.some((t) => t.podAffinityTerm.topologyKey === 'kubernetes.io/hostname'),
        'expert pods are not spread by anti-affinity');
}
// Synthetic checkpoints: an expert pod writes only its own range (the ranges file and its
// ordinal, as expert-svc reads them), router and attention pods only the dense part.
for (const w of workloads) {
  const init = (w.spec.template.spec.initContainers || []).find((c) => c.name === 'synthetic-checkpoint');
  if (!init) continue;
  const component = w.metadata.labels['app.kubernetes.io/component'];
  if (component === 'expert') {
    check(init.args.includes('--ranges_file=/etc/moe/ranges.json') && init.args.includes('--ordinal=-1'),
          `${w.metadata.name}: the synthetic checkpoint is not limited to the pod's range`);
  } else {
    check(init.args.includes('--dense_only'), `${w.metadata.name}: the synthetic checkpoint writes experts`);
  }
}
// Pod Security "restricted" (what namespaces enforcing it admit), but for IPC_LOCK with RDMA:
// non-root, RuntimeDefault seccomp, no privilege escalation, every capability dropped, a
// read-only root filesystem, only volume types the profile allows.
for (const w of workloads) {
  const spec = w.spec.template.spec;
  const name = w.metadata.name;
  check(spec.securityContext?.runAsNonRoot === true && spec.securityContext?.runAsUser > 0,
        `${name}: the pod may run as root`);
  check(spec.securityContext?.seccompProfile?.type === 'RuntimeDefault', `${name}: no RuntimeDefault seccomp profile`);
  for (const c of [...(spec.initContainers || []), ...spec.containers]) {
    const sc = c.securityContext || {};
    check(sc.allowPrivilegeEscalation === false, `${name}/${c.name}: privilege escalation allowed`);
    check(sc.readOnlyRootFilesystem === true, `${name}/${c.name}: writable root filesystem`);
    check((sc.capabilities?.drop || []).includes('ALL'), `${name}/${c.name}: capabilities not dropped`);
    const added = sc.capabilities?.add || [];
    check(added.every((a) => a === 'IPC_LOCK') && (added.length === 0 || arg('expect-rdma')),
          `${name}/${c.name}: adds capabilities ${added}`);
    check(!sc.privileged, `${name}/${c.name}: privileged`);
  }
  // Pod Security "restricted" volume types (csi: cert-manager's per-pod certificates).
  const allowed = ['configMap', 'secret', 'emptyDir', 'persistentVolumeClaim', 'projected', 'downwardAPI', 'csi',
    'name'];
  for (const v of spec.volumes || []) {
    check(Object.keys(v).every((k) => allowed.includes(k)), `${name}: volume ${v.name} of a type "restricted" forbids`);
  }
  // A config change rolls the pods: the model ConfigMap's checksum on the pod template.
  check(/^[0-9a-f]{64}$/.test(w.spec.template.metadata.annotations?.['checksum/config'] || ''),
        `${name}: no checksum/config annotation`);
}
// The attention HPA: scales the attention Deployment, which then leaves replicas to it.
{
  const hpas = byKind('HorizontalPodAutoscaler');
  const attention = byKind('Deployment').find((d) => d.metadata.labels['app.kubernetes.io/component'] === 'attention');
  if (flag('expect-hpa')) {
    check(hpas.length === 1 && hpas[0].spec.scaleTargetRef.kind === 'Deployment' &&
          hpas[0].spec.scaleTargetRef.name === attention.metadata.name,
          'the HPA does not scale the attention Deployment');
    check(attention.spec.replicas === undefined, 'the attention Deployment sets replicas under an HPA');
    check(hpas[0].spec.minReplicas <= hpas[0].spec.maxReplicas, 'HPA minReplicas > maxReplicas');
  } else {
    check(hpas.length === 0, `${hpas.length} HPAs without attention.autoscaling.enabled`);
  }
}
// The checksum of every workload is the same (one ConfigMap), and it is recorded for the test
// that renders another config (chart_test.sh compares).
if (arg('print-checksum')) {
  fs.writeFileSync(arg('print-checksum'), workloads[0].spec.template.metadata.annotations['checksum/config']);
}
if (flag('expect-gpu')) {
  const sts = byKind('StatefulSet').find((d) => d.metadata.labels['app.kubernetes.io/component'] === 'expert');
  const spec = sts.spec.template.spec;
  check(Object.keys(spec.containers[0].resources.limits).some((k) => k.endsWith('/gpu')), 'expert pods ask for no GPU');
  check(spec.nodeSelector && Object.keys(spec.nodeSelector).length > 0, 'expert pods have no node selector for GPU nodes');
  check(spec.tolerations && spec.tolerations.length > 0, 'expert pods tolerate no GPU taint');
}

// --expect-pod-extras: every component's pods carry what tests/deploy/pod-extras.yaml asks for
// (labels and annotations beside the chart's, runtime and priority classes, extra flags last and
// extra environment), and the chart's own labels and checksum are still there.
if (flag('expect-pod-extras')) {
  for (const w of workloads) {
    const c = w.metadata.labels['app.kubernetes.io/component'];
    const t = w.spec.template;
    const box = t.spec.containers[0];
    check(t.metadata.labels.team === `ml-${c}`, `${c}: pod label team is ${t.metadata.labels.team}`);
    check(t.metadata.labels['app.kubernetes.io/component'] === c, `${c}: the chart's labels are gone`);
    check(t.metadata.annotations['k8s.v1.cni.cncf.io/networks'] === `rdma-net-${c}`,
          `${c}: no network annotation (${JSON.stringify(t.metadata.annotations)})`);
    check(t.metadata.annotations['checksum/config'], `${c}: no checksum/config next to the extras`);
    check(t.spec.runtimeClassName === `rc-${c}`, `${c}: runtimeClassName ${t.spec.runtimeClassName}`);
    check(t.spec.priorityClassName === `pc-${c}`, `${c}: priorityClassName ${t.spec.priorityClassName}`);
    check(box.args[box.args.length - 1] === `--log_level=debug`, `${c}: extra flag not last: ${box.args.slice(-2)}`);
    check((box.env || []).some((e) => e.name === 'EXTRA_ENV' && e.value === c),
          `${c}: no EXTRA_ENV=${c} in ${JSON.stringify(box.env)}`);
  }
} else {
  for (const w of workloads) {
    const t = w.spec.template;
    check(!t.spec.runtimeClassName && !t.spec.priorityClassName && !t.metadata.labels.team,
          `${w.metadata.name}: pod extras without values`);
  }
}
// NetworkPolicies (network_policy_checks.mjs).
checkNetworkPolicies({ byKind, workloads, flagValue, matches, check,
                       expectNone: flag('expect-no-networkpolicy') });

// --expect-name-prefix: every object's name (fullnameOverride).
if (arg('expect-name-prefix')) {
  for (const d of docs) {
    check(d.metadata.name.startsWith(arg('expect-name-prefix')),
          `${d.kind} ${d.metadata.name} does not start with ${arg('expect-name-prefix')}`);
  }
}

if (failures.length) {
  for (const f of failures) console.error(`FAIL: ${f}`);
  process.exit(1);
}
console.log('PASS');
