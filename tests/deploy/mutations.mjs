// The mutations validate.mjs --mutate NAME applies: each breaks rendered manifests on purpose,
// so chart_test.sh can show each check of validate.mjs failing.
export function mutationsOf(docs) {
  return {
    'sts-replicas': () => { docs.find((d) => d.kind === 'StatefulSet' && d.metadata.labels['app.kubernetes.io/component'] === 'expert').spec.replicas += 1; },
    'range-gap': () => {
      const cm = docs.find((d) => d.data && d.data['ranges.json']);
      const t = JSON.parse(cm.data['ranges.json']);
      t.ranges[0][1] -= 1;
      cm.data['ranges.json'] = JSON.stringify(t);
    },
    'no-resources': () => { delete docs.find((d) => d.kind === 'Deployment').spec.template.spec.containers[0].resources; },
    'probe-port': () => { docs.find((d) => d.kind === 'Deployment').spec.template.spec.containers[0].readinessProbe.grpc.port += 1; },
    'service-selector': () => { docs.find((d) => d.kind === 'Service').spec.selector['app.kubernetes.io/component'] = 'nobody'; },
    'port-type': () => { docs.find((d) => d.kind === 'Deployment').spec.template.spec.containers[0].ports[0].containerPort = 'grpc'; },
    'root': () => { docs.find((d) => d.kind === 'StatefulSet' && d.metadata.labels['app.kubernetes.io/component'] === 'expert').spec.template.spec.securityContext.runAsNonRoot = false; },
    'writable-root': () => { docs.find((d) => d.kind === 'Deployment').spec.template.spec.containers[0].securityContext.readOnlyRootFilesystem = false; },
    'router-state-lost': () => {
      const r = docs.find((d) => d.metadata?.labels?.['app.kubernetes.io/component'] === 'router' && d.kind === 'StatefulSet');
      r.spec.template.spec.containers[0].args = r.spec.template.spec.containers[0].args.filter((a) => !a.startsWith('--state_db'));
    },
    'pdb-range': () => {
      const p = docs.find((d) => d.kind === 'PodDisruptionBudget');
      p.spec.selector.matchExpressions[0].values.pop();
      p.spec.selector.matchExpressions[0].values.push('nobody-7');
    },
    'extras-leak': () => { docs.find((d) => d.kind === 'Deployment').spec.template.spec.runtimeClassName = 'x'; },
    'no-checksum': () => { delete docs.find((d) => d.kind === 'Deployment').spec.template.metadata.annotations['checksum/config']; },
    // The experts' gRPC and data-plane ports open to every pod.
    'netpol-open': () => { delete docs.find((d) => d.kind === 'NetworkPolicy').spec.ingress[0].from; },
    // UCX listening outside the ports the policies admit.
    'ucx-ports': () => {
      const box = docs.find((d) => d.kind === 'StatefulSet' && d.metadata.labels['app.kubernetes.io/component'] === 'expert').spec.template.spec.containers[0];
      box.env = box.env.filter((e) => e.name !== 'UCX_TCP_PORT_RANGE');
    },
  };
}
