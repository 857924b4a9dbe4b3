#!/usr/bin/env bash
# The Helm chart and the image recipe, checked offline (no Kubernetes API server, Docker engine
# or helm binary can run here):
#   * the chart rendered by tests/deploy/render (Go text/template + sprig, Helm's engine) for the
#     default values, values-k3.yaml and a third set (claim, existing Secret, 5 ranges x 3
#     replicas, two layers), each validated by validate.mjs (Kubernetes schemas + invariants);
#   * bad values fail to render with a clear message; deliberately broken manifests fail
#     validation (each invariant can fail);
#   * the chart's model configs are what moe-tool writes, its dashboard is deploy/grafana's;
#   * the Dockerfile's runtime packages hold every shared library the binaries need;
#   * values.schema.json accepts the chart's values files and refuses typos and bad enums;
#     kubeVersion is declared; pods are Pod Security "restricted"; a config change changes the
#     pods' checksum annotation; the attention HPA.
# Usage: chart_test.sh WORK_DIR MOE_TOOL BIN_DIR
set -euo pipefail
trap 'echo "FAIL: line $LINENO: $BASH_COMMAND"' ERR
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=$1
MOE_TOOL=$2
BIN_DIR=$3
CHART=$ROOT/deploy/helm/moe-serving
DASH=$ROOT/deploy/grafana/moe-dashboard.json
mkdir -p "$WORK"
cd "$ROOT/tests/deploy"

GO111MODULE=off GOPATH=/usr/share/gocode GOCACHE="$WORK/gocache" \
  go build -o "$WORK/render" ./render
render_as_given() { "$WORK/render" -chart "$CHART" -release moe -namespace serving "$@"; }
# Members speak TLS by default and the chart refuses plaintext unless asked for by name: the
# renders below that test other features ask for it (insecure=true) unless they set tls.*.
render() {
  local plain=(-set insecure=true)
  for a in "$@"; do case $a in tls.*) plain=() ;; esac; done
  render_as_given "${plain[@]}" "$@"
}

echo "== chart files"
for preset in tiny mid k3; do
  "$MOE_TOOL" config --config "$preset" | cmp - "$CHART/files/config-$preset.json"
done
cmp "$DASH" "$CHART/files/moe-dashboard.json"

# The placement tables the chart must render (services/placement's rule, via moe-tool).
"$MOE_TOOL" ranges --config mid --shards 2 --replicas 1 >"$WORK/ranges-default.json"
"$MOE_TOOL" ranges --config k3 --shards 8 --replicas 2 >"$WORK/ranges-k3.json"
"$MOE_TOOL" ranges --config mid --shards 5 --replicas 3 >"$WORK/ranges-claim.json"

echo "== secure by default: TLS members, per-pod identities from cert-manager, plaintext only by name"
# Without cert-manager and without a PKI given, the default values refuse to render.
if render_as_given -out "$WORK/refused.yaml" 2>"$WORK/refused.err"; then
  echo "FAIL: the default values rendered without a PKI"; exit 1
fi
grep -q "TLS (the default) needs a PKI" "$WORK/refused.err"
grep -q "plaintext only when asked for by name: insecure=true" "$WORK/refused.err"
if render_as_given -set tls.enabled=false -out "$WORK/refused.yaml" 2>"$WORK/refused.err"; then
  echo "FAIL: tls.enabled=false rendered plaintext members without insecure=true"; exit 1
fi
grep -q "plaintext members are rendered only when asked for by name" "$WORK/refused.err"
# With cert-manager in the cluster: a CA issuer of the release's own, every pod its own
# certificate (CSI driver) naming its SPIFFE identity, members bound to it, no plain REST front.
render_as_given -api cert-manager.io/v1 -out "$WORK/secure-default.yaml"
node validate.mjs --manifests "$WORK/secure-default.yaml" --dashboard "$DASH" \
  --expect-ranges "$WORK/ranges-default.json" --expect-tls
test "$(grep -c '^kind: Issuer' "$WORK/secure-default.yaml")" -eq 2
grep -q '^kind: Certificate' "$WORK/secure-default.yaml"
grep -q '  isCA: true' "$WORK/secure-default.yaml"
test "$(grep -c 'csi.cert-manager.io/issuer-name: moe-moe-serving-ca' "$WORK/secure-default.yaml")" -eq 3
for role in expert attention router; do
  grep -q "csi.cert-manager.io/uri-sans: \"spiffe://moe/$role/\${POD_NAME}\"" "$WORK/secure-default.yaml"
done
test "$(grep -c -- '- --tls_member_identity=true' "$WORK/secure-default.yaml")" -eq 3
if grep -q -- "--http_port" "$WORK/secure-default.yaml"; then
  echo "FAIL: the plain-HTTP REST front is rendered on a TLS cluster"; exit 1
fi
# Your own issuer or Secret: no bootstrap CA of the chart's.
render_as_given -api cert-manager.io/v1 -set tls.perPodIssuer.name=moe-ca -out "$WORK/own-issuer.yaml"
if grep -q '^kind: Issuer' "$WORK/own-issuer.yaml"; then echo "FAIL: a CA bootstrapped beside the given issuer"; exit 1; fi

echo "== default values, plaintext asked for by name (insecure=true)"
render -out "$WORK/default.yaml" -notes "$WORK/default-notes.txt"
node validate.mjs --manifests "$WORK/default.yaml" --dashboard "$DASH" \
  --expect-ranges "$WORK/ranges-default.json" --print-checksum "$WORK/checksum-default"
grep -q "svc/moe-moe-serving-attention" "$WORK/default-notes.txt"
grep -q -- "- --http_port=8000" "$WORK/default.yaml"  # the REST front, a Service port too

echo "== values.schema.json and kubeVersion"
schema() { node values_schema.mjs --schema "$CHART/values.schema.json" --values "$CHART/values.yaml" "$@"; }
schema
schema --values "$CHART/values-k3.yaml"
schema --set tls.enabled=true --set tls.existingSecret=moe-tls --set attention.autoscaling.enabled=true
schema --set dataPlane.mode=rdma --expect-invalid "/dataPlane/mode"
schema --set experts.shard=4 --expect-invalid "(shard)"
schema --set router.biasMode=sometimes --expect-invalid "/router/biasMode"
schema --set attention.workers=0 --expect-invalid "/attention/workers"
schema --set ports.grpc=70000 --expect-invalid "/ports/grpc"
schema --set attention.precision=w4a8 --set experts.precision=w4a16,w4a8
schema --set attention.precision=fp8 --expect-invalid "/attention/precision"
grep -q '^kubeVersion: ">=1.25.0-0"' "$CHART/Chart.yaml"

echo "== a config change rolls the pods (checksum/config)"
render -set model.preset=tiny -out "$WORK/tiny.yaml"
node validate.mjs --manifests "$WORK/tiny.yaml" --dashboard "$DASH" --print-checksum "$WORK/checksum-tiny" \
  --expect-ranges <("$MOE_TOOL" ranges --config tiny --shards 2 --replicas 1)
if cmp -s "$WORK/checksum-default" "$WORK/checksum-tiny"; then
  echo "FAIL: another model config leaves the pods' checksum/config unchanged"; exit 1
fi

echo "== router-svc's state without a claim: an emptyDir"
render -set router.persistence.enabled=false -out "$WORK/router-emptydir.yaml"
node validate.mjs --manifests "$WORK/router-emptydir.yaml" --dashboard "$DASH" \
  --expect-ranges "$WORK/ranges-default.json" --expect-router-emptydir

echo "== member tokens: derived as the binaries derive them, each expert pod its own name's"
# The default render's Secret: an expert pod's token is hex SHA-256 of "<secret>:expert:<pod>",
# the attention tier's of "<secret>:attention" (transport::ExpertMemberToken and MemberRoleToken,
# pinned to known values in TlsOptions.MemberTokens).
secret_key() {  # secret_key KEY: the decoded value of the cluster Secret's key
  awk -v k="  $1:" '$0 ~ "^"k {print $2}' "$WORK/default.yaml" | tr -d '"' | base64 -d
}
s=$(secret_key cluster-token)
test "${#s}" -eq 32
experts=$(awk '/kind: StatefulSet/{f=1} f && /name: .*-expert$/{e=1} e && /replicas:/{print $2; exit}' "$WORK/default.yaml")
test "$experts" -ge 2
pods=$(grep -o '^  expert-token-[a-z0-9-]*' "$WORK/default.yaml" | sed 's/^  expert-token-//')
test "$(echo "$pods" | wc -l)" -eq "$experts"
for pod in $pods; do
  test "$(secret_key "expert-token-$pod")" = "$(printf '%s:expert:%s' "$s" "$pod" | sha256sum | cut -d' ' -f1)"
done
if grep -q '^  expert-token:' "$WORK/default.yaml"; then echo "FAIL: a token shared by every expert"; exit 1; fi
test "$(secret_key attention-token)" = "$(printf '%s:attention' "$s" | sha256sum | cut -d' ' -f1)"
test "$(secret_key attention-token-sha256)" = "$(secret_key attention-token | tr -d '\n' | sha256sum | cut -d' ' -f1)"
# Items: the router reads the secret, experts the experts' tokens (each pod reads its own by
# name) and the digest, attention its token.
test "$(grep -c -- '- key: expert-token-' "$WORK/default.yaml")" -eq "$experts"
grep -q -- '- --cluster_token_file=/var/run/moe/cluster/expert-token-$(POD_NAME)' "$WORK/default.yaml"
test "$(grep -c -- '- key: attention-token$' "$WORK/default.yaml")" -eq 1
test "$(grep -c -- '- key: cluster-token' "$WORK/default.yaml")" -eq 1
grep -q -- '- --attention_token_sha256_file=/var/run/moe/cluster/attention-token-sha256' "$WORK/default.yaml"

echo "== per-pod certificates (cert-manager's CSI driver) naming each member's identity"
render -set tls.enabled=true -set tls.perPodIssuer.name=moe-ca -out "$WORK/tls-perpod.yaml"
node validate.mjs --manifests "$WORK/tls-perpod.yaml" --dashboard "$DASH" \
  --expect-ranges "$WORK/ranges-default.json" --expect-tls
for role in expert attention router; do
  grep -q "csi.cert-manager.io/uri-sans: \"spiffe://moe/$role/\${POD_NAME}\"" "$WORK/tls-perpod.yaml"
done
test "$(grep -c -- '- --tls_member_identity=true' "$WORK/tls-perpod.yaml")" -eq 3
if grep -q 'secretName: moe-tls' "$WORK/tls-perpod.yaml"; then echo "FAIL: a shared TLS Secret"; exit 1; fi
render -set tls.enabled=true -set tls.existingSecret=moe-tls -out "$WORK/tls-shared.yaml"
test "$(grep -c -- '- --tls_member_identity=false' "$WORK/tls-shared.yaml")" -eq 3
if grep -q -- "--http_port" "$WORK/tls-shared.yaml"; then
  echo "FAIL: the plain-HTTP REST front is rendered on a TLS cluster"; exit 1
fi

echo "== --initialize on the first install only (and always for an emptyDir, lost with its pod)"
grep -q -- '- --initialize$' "$WORK/default.yaml"
render -upgrade -out "$WORK/upgrade.yaml"
if grep -q -- '--initialize' "$WORK/upgrade.yaml"; then
  echo "FAIL: helm upgrade renders router-svc --initialize (a lost state would start over)"; exit 1
fi
render -set router.initializeOnInstall=false -out "$WORK/no-init.yaml"
if grep -q -- '--initialize' "$WORK/no-init.yaml"; then
  echo "FAIL: router.initializeOnInstall=false still renders --initialize"; exit 1
fi
grep -q -- '- --initialize$' "$WORK/router-emptydir.yaml"
render -upgrade -set router.persistence.enabled=false -out "$WORK/upgrade-emptydir.yaml"
grep -q -- '- --initialize$' "$WORK/upgrade-emptydir.yaml"

echo "== three routers on etcd, one leading"
render -set router.replicas=3 -set router.etcd.endpoint=etcd.infra:2379 -out "$WORK/router-etcd.yaml"
node validate.mjs --manifests "$WORK/router-etcd.yaml" --dashboard "$DASH" \
  --expect-ranges "$WORK/ranges-default.json" --expect-router-etcd etcd.infra:2379

echo "== the attention HPA"
render -set attention.autoscaling.enabled=true -set attention.autoscaling.maxReplicas=6 \
  -out "$WORK/hpa.yaml"
node validate.mjs --manifests "$WORK/hpa.yaml" --dashboard "$DASH" \
  --expect-ranges "$WORK/ranges-default.json" --expect-hpa
grep -q "cannot change the bias" "$WORK/default-notes.txt"

echo "== values-k3.yaml with an admin token"
render -f "$CHART/values-k3.yaml" -set admin.token=s3cret -out "$WORK/k3.yaml"
node validate.mjs --manifests "$WORK/k3.yaml" --dashboard "$DASH" --expect-admin-secret unused \
  --expect-servicemonitor --expect-gpu --expect-ranges "$WORK/ranges-k3.json"
grep -q 'num_experts.\{1,2\}:896' "$WORK/k3.yaml"

echo "== claim, existing Secret, 5 ranges x 3 replicas, layers 1,2"
render -set checkpoint.existingClaim=weights -set checkpoint.subPath=k3/ckpt \
  -set admin.existingSecret=moe-admin -set membership.existingSecret=moe-members \
  -set experts.shards=5 -set experts.replicasPerRange=3 \
  -set 'model.layers=[1, 2]' -set serviceMonitor.enabled=true -set grafanaDashboard.enabled=true \
  -out "$WORK/claim.yaml"
node validate.mjs --manifests "$WORK/claim.yaml" --dashboard "$DASH" --expect-admin-secret moe-admin \
  --expect-cluster-secret moe-members \
  --expect-servicemonitor --expect-ranges "$WORK/ranges-claim.json"
grep -q "claimName: weights" "$WORK/claim.yaml"
if grep -q "name: moe-moe-serving-cluster$" "$WORK/claim.yaml"; then
  echo "FAIL: a cluster-token Secret is made although membership.existingSecret is given"; exit 1
fi
grep -q -- "--checkpoint=/models/k3/ckpt" "$WORK/claim.yaml"
grep -q -- "--layers=1,2" "$WORK/claim.yaml"
if grep -q "synthetic-checkpoint" "$WORK/claim.yaml"; then
  echo "FAIL: an init container writes a synthetic checkpoint although a claim is given"; exit 1
fi

echo "== W4A8: the attention node's default and the shards' modes reach the flags"
render -set attention.precision=w4a8 -set experts.precision=w4a16 -out "$WORK/w4a8.yaml"
node validate.mjs --manifests "$WORK/w4a8.yaml" --dashboard "$DASH" \
  --expect-ranges "$WORK/ranges-default.json"
grep -q -- "--precision=w4a8" "$WORK/w4a8.yaml"
grep -q -- "--precision=w4a16$" "$WORK/w4a8.yaml"
grep -q -- "--precision=w4a16$" "$WORK/default.yaml"  # attention-svc's default
if [ "$(grep -c -- "--precision=" "$WORK/default.yaml")" != 1 ]; then
  echo "FAIL: the default values pass --precision to the expert pods"; exit 1
fi

echo "== the data plane: UCX over RDMA verbs with the device resource"
render -set dataPlane.mode=ucx -set dataPlane.ucxTls=rc,ud,tcp -set dataPlane.rdma.enabled=true \
  -out "$WORK/rdma.yaml"
node validate.mjs --manifests "$WORK/rdma.yaml" --dashboard "$DASH" \
  --expect-ranges "$WORK/ranges-default.json" --expect-data-plane ucx --expect-ucx-tls rc,ud,tcp \
  --expect-rdma rdma/hca_shared_devices_a
node validate.mjs --manifests "$WORK/default.yaml" --dashboard "$DASH" \
  --expect-ranges "$WORK/ranges-default.json" --expect-data-plane auto --expect-ucx-tls tcp

echo "== mutual TLS on every channel from a cert-manager style Secret"
render -set tls.enabled=true -set tls.existingSecret=moe-tls -out "$WORK/tls.yaml"
node validate.mjs --manifests "$WORK/tls.yaml" --dashboard "$DASH" \
  --expect-ranges "$WORK/ranges-default.json" --expect-tls --expect-tls-secret moe-tls

echo "== pod extras per component, and fullnameOverride"
cat >"$WORK/pod-extras.yaml" <<'YAML'
fullnameOverride: serve
router:
  podLabels: {team: ml-router}
  podAnnotations: {k8s.v1.cni.cncf.io/networks: rdma-net-router}
  runtimeClassName: rc-router
  priorityClassName: pc-router
  extraArgs: [--log_level=debug]
  extraEnv: [{name: EXTRA_ENV, value: router}]
attention:
  podLabels: {team: ml-attention}
  podAnnotations: {k8s.v1.cni.cncf.io/networks: rdma-net-attention}
  runtimeClassName: rc-attention
  priorityClassName: pc-attention
  extraArgs: [--log_level=debug]
  extraEnv: [{name: EXTRA_ENV, value: attention}]
experts:
  podLabels: {team: ml-expert}
  podAnnotations: {k8s.v1.cni.cncf.io/networks: rdma-net-expert}
  runtimeClassName: rc-expert
  priorityClassName: pc-expert
  extraArgs: [--log_level=debug]
  extraEnv: [{name: EXTRA_ENV, value: expert}]
YAML
schema --values "$WORK/pod-extras.yaml"
render -f "$WORK/pod-extras.yaml" -out "$WORK/pod-extras-rendered.yaml"
node validate.mjs --manifests "$WORK/pod-extras-rendered.yaml" --dashboard "$DASH" \
  --expect-ranges "$WORK/ranges-default.json" --expect-pod-extras --expect-name-prefix serve
grep -q -- "--router=serve-router:" "$WORK/pod-extras-rendered.yaml"
schema --set 'attention.podLabels={"app.kubernetes.io/component": "x"}' \
  --expect-invalid "/attention/podLabels"
schema --set 'experts.extraArgs=["log_level=debug"]' --expect-invalid "/experts/extraArgs/0"

echo "== the CPU kernel choice: measured once per pod in /tmp, or a pinned ConfigMap"
grep -A1 "name: MOE_KERNEL_CACHE" "$WORK/default.yaml" | grep -q "value: /tmp/moe-kernels"
render -set experts.kernelsConfigMap=k3-kernels -out "$WORK/kernels.yaml"
node validate.mjs --manifests "$WORK/kernels.yaml" --dashboard "$DASH" \
  --expect-ranges "$WORK/ranges-default.json"
grep -A1 "name: MOE_KERNEL_CACHE" "$WORK/kernels.yaml" | grep -q "value: /etc/moe-kernels"
grep -B1 -A1 "mountPath: /etc/moe-kernels" "$WORK/kernels.yaml" | grep -q "readOnly: true"
grep -A2 "name: kernels" "$WORK/kernels.yaml" | grep -q "name: k3-kernels"
schema --set 'experts.kernelsConfigMap="../etc"' --expect-invalid "/experts/kernelsConfigMap"

echo "== bad values fail to render, with the reason"
expect_render_error() {
  local want=$1; shift
  if render "$@" -out "$WORK/bad.yaml" 2>"$WORK/bad.err"; then
    echo "FAIL: rendered with $*"; exit 1
  fi
  grep -q "$want" "$WORK/bad.err" || { echo "FAIL: $* said: $(cat "$WORK/bad.err")"; exit 1; }
  echo "refused ($*): $(grep -o "$want.*" "$WORK/bad.err" | head -1)"
}
expect_render_error "must lie in \[1, E = 128\]" -set experts.shards=0
expect_render_error "must lie in \[1, E = 16\]" -set model.preset=tiny -set experts.shards=17
expect_render_error "replicasPerRange must be at least 1" -set experts.replicasPerRange=0
expect_render_error 'no files/config-huge.json' -set model.preset=huge
expect_render_error 'dataPlane.mode "rdma" must be auto, grpc or ucx' -set dataPlane.mode=rdma
expect_render_error 'TLS (the default) needs a PKI' -set tls.enabled=true
expect_render_error 'router.replicas > 1 needs router.etcd.endpoint' -set router.replicas=2
expect_render_error 'minReplicas 5 is above maxReplicas 2' -set attention.autoscaling.enabled=true \
  -set attention.autoscaling.minReplicas=5 -set attention.autoscaling.maxReplicas=2

echo "== network policies: off, and without the UCX data plane"
render -out "$WORK/nonetpol.yaml" -set networkPolicy.enabled=false
node validate.mjs --manifests "$WORK/nonetpol.yaml" --dashboard "$DASH" --expect-no-networkpolicy
printf 'networkPolicy:\n  metricsFrom:\n    - namespaceSelector:\n        matchLabels: {name: monitoring}\n' \
  >"$WORK/metrics-from.yaml"
render -out "$WORK/grpc-only.yaml" -set dataPlane.mode=grpc -f "$WORK/metrics-from.yaml"
node validate.mjs --manifests "$WORK/grpc-only.yaml" --dashboard "$DASH"
grep -q "name: monitoring" "$WORK/grpc-only.yaml"
expect_render_error 'dataPlane.tcpPorts 20000-20000 must be a range of at least 2 ports' \
  -set dataPlane.tcpPorts.last=20000

echo "== every invariant can fail"
for m in sts-replicas range-gap no-resources probe-port service-selector port-type root writable-root \
  no-checksum router-state-lost pdb-range extras-leak netpol-open ucx-ports; do
  if node validate.mjs --manifests "$WORK/default.yaml" --dashboard "$DASH" --mutate "$m" \
      >"$WORK/mutate.out" 2>&1; then
    echo "FAIL: mutation $m went unnoticed"; exit 1
  fi
  echo "caught $m: $(grep -m1 FAIL "$WORK/mutate.out")"
done

echo "== the image's runtime packages hold every shared library the binaries need"
RUNTIME=$(sed -n '/^FROM .* AS runtime/,/^COPY/p' "$ROOT/deploy/docker/Dockerfile")
grep -q "libucx0" <<<"$RUNTIME" || { echo "FAIL: the runtime stage lacks the UCX runtime"; exit 1; }
grep -q "scripts/setup.sh --build-only" "$ROOT/deploy/docker/Dockerfile"
for b in router-svc attention-svc expert-svc moe-cli; do
  for f in "$BIN_DIR/$b" "$MOE_TOOL"; do
    for so in $(objdump -p "$f" | awk '/NEEDED/{print $2}'); do
      # (no early exit in awk: with pipefail, a SIGPIPE in ldd would end the script)
      path=$(ldd "$f" | awk -v s="$so" '$1==s && !seen++{print $3}')
      case "$path" in
        /usr/local/cuda*)  # CUDA builds: the image's CUDA variant installs these from NVIDIA
          case "$so" in
            libcudart*) pkg=cuda-cudart ;;
            libcublas*) pkg=libcublas ;;
            *) echo "FAIL: $b needs an unexpected CUDA library $so"; exit 1 ;;
          esac
          grep -q -- "$pkg" <<<"$RUNTIME" || { echo "FAIL: $b needs $so ($path), not in the CUDA runtime stage"; exit 1; }
          continue ;;
      esac
      pkg=$(dpkg -S "$path" 2>/dev/null || dpkg -S "/usr$path" 2>/dev/null || true)
      pkg=${pkg%%:*}
      case "$pkg" in
        libc6|libstdc++6|libgcc-s1) ;;  # in the debian:12 base image
        "") echo "FAIL: no package for $so ($path)"; exit 1 ;;
        *) grep -qw -- "$pkg" <<<"$RUNTIME" || { echo "FAIL: $b needs $so from $pkg, not in the runtime stage"; exit 1; } ;;
      esac
    done
  done
done
echo "runtime libraries: covered"
echo PASS
