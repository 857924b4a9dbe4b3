// The NetworkPolicy checks of validate.mjs: the expert pods admit their gRPC port and the UCX
// ports only from the attention pods, the attention pods the UCX ports only from the expert
// pods; the UCX ports are the range every attention and expert container gives UCX
// (UCX_TCP_PORT_RANGE), so UCX listens nowhere the policies do not name. With
// expectNone (--expect-no-networkpolicy): there are none.
export function checkNetworkPolicies({ byKind, workloads, flagValue, matches, check, expectNone }) {
  const policies = byKind('NetworkPolicy');
  const podsOf = (c) => workloads.find((w) => w.metadata.labels['app.kubernetes.io/component'] === c);
  const range = (c) => {
    const w = podsOf(c);
    const e = (w?.spec.template.spec.containers[0].env || []).find((x) => x.name === 'UCX_TCP_PORT_RANGE');
    return e ? e.value.split('-').map(Number) : undefined;
  };
  if (!expectNone) {
    check(policies.length === 2, `${policies.length} NetworkPolicies (expected the expert and attention ones)`);
    const ucx = !(flagValue(podsOf('expert')?.spec.template.spec.containers[0].args, 'data_plane') === 'grpc');
    for (const [c, peer] of [['expert', 'attention'], ['attention', 'expert']]) {
      const np = policies.find((p) => matches(p.spec.podSelector.matchLabels, podsOf(c)?.spec.template.metadata.labels));
      check(np, `no NetworkPolicy selects the ${c} pods`);
      if (!np) continue;
      check(JSON.stringify(np.spec.policyTypes) === '["Ingress"]', `${np.metadata.name}: policyTypes ${np.spec.policyTypes}`);
      const r = range(c);
      check(r && r.length === 2 && r[0] < r[1], `${c} pods give UCX no port range (UCX_TCP_PORT_RANGE)`);
      // Every rule that names a UCX port, or an expert's gRPC port, admits only the peer's pods.
      const grpc = Number(flagValue(podsOf(c).spec.template.spec.containers[0].args, 'port'));
      let ucxRule = false;
      for (const rule of np.spec.ingress || []) {
        for (const port of rule.ports || []) {
          const isUcx = r && port.port === r[0] && port.endPort === r[1];
          const guarded = isUcx || (c === 'expert' && port.port === grpc);
          if (!guarded) continue;
          ucxRule ||= isUcx;
          const from = rule.from || [];
          check(from.length > 0 && from.every((f) => f.podSelector &&
                  matches(f.podSelector.matchLabels, podsOf(peer).spec.template.metadata.labels) &&
                  !f.namespaceSelector && !f.ipBlock),
                `${np.metadata.name}: port ${port.port} admits more than the ${peer} pods`);
        }
        // No rule opens a port range wider than UCX's.
        for (const port of rule.ports || []) {
          check(port.endPort === undefined || (r && port.port === r[0] && port.endPort === r[1]),
                `${np.metadata.name}: a port range ${port.port}-${port.endPort} that is not UCX's`);
        }
      }
      check(ucxRule === ucx, `${np.metadata.name}: the UCX ports are ${ucxRule ? '' : 'not '}admitted with data plane ${ucx ? 'on' : 'off'}`);
    }
  } else {
    check(policies.length === 0, `${policies.length} NetworkPolicies with networkPolicy.enabled=false`);
  }
}
