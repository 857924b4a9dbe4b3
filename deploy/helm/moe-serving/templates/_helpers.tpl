{{/* Names: fullnameOverride when set, else <release>-<name> unless the release name already
contains the name (name: nameOverride or the chart's). 40 characters at most: pod names add
suffixes. */}}
{{- define "moe.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- define "moe.fullname" -}}
{{- $name := include "moe.name" . -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* A component's own pod extras, (dict "c" .Values.<component>): labels and annotations
(podLabels, podAnnotations) under the chart's, and its runtime and priority classes. */}}
{{- define "moe.podExtraLabels" -}}
{{- with .c.podLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}
{{- define "moe.podExtraAnnotations" -}}
{{- with .c.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end -}}
{{- define "moe.podClasses" -}}
{{- with .c.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .c.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- end -}}
{{/* The container's extra arguments (extraArgs, appended: a flag given twice takes the last
value) and environment (extraEnv, EnvVar objects). */}}
{{- define "moe.extraArgs" -}}
{{- range .c.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}
{{- define "moe.extraEnv" -}}
{{- with .c.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "moe.labels" -}}
app.kubernetes.io/name: {{ include "moe.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: (dict "ctx" $ "component" "router") */}}
{{- define "moe.selectorLabels" -}}
app.kubernetes.io/name: {{ include "moe.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "moe.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "moe.routerService" -}}{{ include "moe.fullname" . }}-router{{- end -}}
{{- define "moe.expertHeadless" -}}{{ include "moe.fullname" . }}-expert{{- end -}}
{{- define "moe.clusterSecret" -}}
{{- default (printf "%s-cluster" (include "moe.fullname" .)) .Values.membership.existingSecret -}}
{{- end -}}
{{/* Membership tokens as files (never on a command line or in the environment), per role
(dict "ctx" $ "role" router|expert|attention): the router reads the cluster secret, an expert
its role's token and the attention token's SHA-256, an attention node its role's token. */}}
{{- define "moe.clusterTokenFlag" -}}
{{- $ctx := .ctx -}}
{{- if eq .role "router" }}
- --cluster_token_file=/var/run/moe/cluster/{{ $ctx.Values.membership.secretKey }}
{{- else if eq .role "expert" }}
- --cluster_token_file=/var/run/moe/cluster/expert-token-$(POD_NAME)
- --attention_token_sha256_file=/var/run/moe/cluster/attention-token-sha256
{{- else }}
- --cluster_token_file=/var/run/moe/cluster/attention-token
{{- end }}
{{- include "moe.tlsFlags" $ctx }}
{{- end -}}

{{/* The membership Secret's keys a role's pod may read (the volume's items). */}}
{{- define "moe.memberVolume" -}}
{{- $ctx := .ctx -}}
- name: cluster-token
  secret:
    secretName: {{ include "moe.clusterSecret" $ctx }}
    defaultMode: 288  # 0440: the pod's group (fsGroup) reads it, nobody else
    items:
      {{- if eq .role "router" }}
      - key: {{ $ctx.Values.membership.secretKey }}
        path: {{ $ctx.Values.membership.secretKey }}
      {{- else if eq .role "expert" }}
      {{- /* Every expert pod's token: a StatefulSet's pods share one template, so a pod reads
      its own by name (--cluster_token_file=...-$(POD_NAME)); per-pod isolation of the
      credential itself needs per-pod certificates (tls.perPodIssuer). */}}
      {{- $ranges := include "moe.ranges" $ctx | fromJson }}
      {{- range $i := until (int (mul (len $ranges.ranges) (int $ctx.Values.experts.replicasPerRange))) }}
      {{- $key := printf "expert-token-%s-expert-%d" (include "moe.fullname" $ctx) $i }}
      - key: {{ $key }}
        path: {{ $key }}
      {{- end }}
      - key: attention-token-sha256
        path: attention-token-sha256
      {{- else }}
      - key: attention-token
        path: attention-token
      {{- end }}
{{- end -}}
{{/* Whether members speak TLS: "true" unless plaintext is asked for by name (insecure=true);
tls.enabled=false alone is refused. */}}
{{- define "moe.tlsOn" -}}
{{- if not .Values.insecure -}}
{{- if not .Values.tls.enabled -}}
{{- fail "tls.enabled=false: plaintext members are rendered only when asked for by name (insecure=true); members without TLS hold only per-member tokens (docs/security.md)" -}}
{{- end -}}
true
{{- end -}}
{{- end -}}

{{/* The cert-manager issuer that gives every pod a certificate of its own (members act only as
themselves): tls.perPodIssuer, else, with neither it nor tls.existingSecret and cert-manager in
the cluster, the CA issuer this chart bootstraps (certmanager-ca.yaml); "" for the shared
Secret. Fails when TLS has no PKI at all. */}}
{{- define "moe.tlsIssuer" -}}
{{- if .Values.tls.perPodIssuer.name -}}
{{ .Values.tls.perPodIssuer.name }}
{{- else if not .Values.tls.existingSecret -}}
{{- if .Capabilities.APIVersions.Has "cert-manager.io/v1" -}}
{{ include "moe.fullname" . }}-ca
{{- else -}}
{{- fail "TLS (the default) needs a PKI: cert-manager with its CSI driver in the cluster (the chart then issues every pod its own certificate), tls.perPodIssuer.name (your cert-manager issuer) or tls.existingSecret (a Secret with tls.crt, tls.key and ca.crt); plaintext only when asked for by name: insecure=true" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* TLS files from the pod's tls volume: its own certificate naming its member identity (a
per-pod issuer: members act only as themselves), or the shared Secret (every member's
certificate equal: identities not bound, names bound by the member tokens). */}}
{{- define "moe.tlsFlags" -}}
{{- if include "moe.tlsOn" . }}
{{- $issuer := include "moe.tlsIssuer" . }}
- --tls_cert_file=/var/run/moe/tls/tls.crt
- --tls_key_file=/var/run/moe/tls/tls.key
- --tls_ca_file=/var/run/moe/tls/ca.crt
- --tls_require_client_cert={{ .Values.tls.requireClientCert }}
- --tls_refresh_seconds={{ .Values.tls.refreshSeconds }}
- --tls_trust_domain={{ .Values.tls.trustDomain }}
- --tls_member_identity={{ if $issuer }}true{{ else }}false{{ end }}
{{- end }}
{{- end -}}

{{/* The pod's tls volume (dict "ctx" $ "role" expert|attention|router): with
tls.perPodIssuer, a certificate of its own from cert-manager's CSI driver naming
spiffe://<tls.trustDomain>/<role>/<pod name> and the DNS names peers dial; else the shared
Secret. */}}
{{- define "moe.tlsVolume" -}}
{{- $ctx := .ctx -}}
{{- $v := $ctx.Values -}}
{{- if include "moe.tlsOn" $ctx }}
{{- $issuer := include "moe.tlsIssuer" $ctx }}
- name: tls
{{- if $issuer }}
  csi:
    driver: csi.cert-manager.io
    readOnly: true
    volumeAttributes:
      csi.cert-manager.io/issuer-name: {{ $issuer }}
      csi.cert-manager.io/issuer-kind: {{ if $v.tls.perPodIssuer.name }}{{ $v.tls.perPodIssuer.kind }}{{ else }}Issuer{{ end }}
      csi.cert-manager.io/issuer-group: {{ if $v.tls.perPodIssuer.name }}{{ $v.tls.perPodIssuer.group }}{{ else }}cert-manager.io{{ end }}
      csi.cert-manager.io/uri-sans: "spiffe://{{ $v.tls.trustDomain }}/{{ .role }}/${POD_NAME}"
      {{- if eq .role "expert" }}
      csi.cert-manager.io/dns-names: "${POD_NAME}.{{ include "moe.expertHeadless" $ctx }}.${POD_NAMESPACE}.svc.cluster.local,localhost"
      {{- else if eq .role "router" }}
      csi.cert-manager.io/dns-names: "{{ include "moe.routerService" $ctx }},{{ include "moe.routerService" $ctx }}.${POD_NAMESPACE}.svc.cluster.local,localhost"
      {{- else }}
      csi.cert-manager.io/dns-names: "{{ include "moe.fullname" $ctx }}-attention,{{ include "moe.fullname" $ctx }}-attention.${POD_NAMESPACE}.svc.cluster.local,localhost"
      {{- end }}
      csi.cert-manager.io/ip-sans: "127.0.0.1"
      csi.cert-manager.io/key-usages: "server auth,client auth,digital signature,key encipherment"
      csi.cert-manager.io/fs-group: "10001"
{{- else }}
  secret:
    secretName: {{ $v.tls.existingSecret }}
    defaultMode: 288
{{- end }}
{{- end }}
{{- end -}}
{{- define "moe.adminSecret" -}}
{{- default (printf "%s-admin" (include "moe.fullname" .)) .Values.admin.existingSecret -}}
{{- end -}}

{{/* The model's config.json: the inline one or the preset's. */}}
{{- define "moe.modelConfig" -}}
{{- if .Values.model.config -}}
{{- .Values.model.config -}}
{{- else -}}
{{- $file := printf "files/config-%s.json" .Values.model.preset -}}
{{- $text := .Files.Get $file -}}
{{- if not $text -}}
{{- fail (printf "model.preset %q: no %s in the chart (tiny, mid or k3)" .Values.model.preset $file) -}}
{{- end -}}
{{- $text -}}
{{- end -}}
{{- end -}}

{{- define "moe.numExperts" -}}
{{- (include "moe.modelConfig" . | fromJson).text_config.num_experts | int -}}
{{- end -}}

{{/* The placement table: experts [0, E) in `shards` contiguous ranges (E*i/n .. E*(i+1)/n),
     read by expert-svc --ranges_file with its StatefulSet ordinal. */}}
{{- define "moe.ranges" -}}
{{- $e := include "moe.numExperts" . | int -}}
{{- $n := .Values.experts.shards | int -}}
{{- if or (lt $n 1) (gt $n $e) -}}
{{- fail (printf "experts.shards = %d must lie in [1, E = %d]" $n $e) -}}
{{- end -}}
{{- if lt (int .Values.experts.replicasPerRange) 1 -}}
{{- fail "experts.replicasPerRange must be at least 1" -}}
{{- end -}}
{{- $ranges := list -}}
{{- range $i := until $n -}}
{{- $ranges = append $ranges (list (div (mul $e $i) $n) (div (mul $e (add1 $i)) $n)) -}}
{{- end -}}
{{- dict "num_experts" $e "replicas_per_range" (int .Values.experts.replicasPerRange) "ranges" $ranges | toJson -}}
{{- end -}}

{{- define "moe.layersFlag" -}}
{{- if .Values.model.layers -}}
- --layers={{ join "," .Values.model.layers }}
{{- end -}}
{{- end -}}

{{/* Volumes every pod has: the model ConfigMap and the checkpoint. */}}
{{- define "moe.volumes" -}}
- name: model
  configMap:
    name: {{ include "moe.fullname" . }}-model
- name: tmp
  emptyDir:
    sizeLimit: 256Mi
- name: checkpoint
{{- if .Values.checkpoint.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.checkpoint.existingClaim }}
    readOnly: true
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.checkpoint.synthetic.sizeLimit }}
{{- end }}
{{- end -}}

{{- define "moe.volumeMounts" -}}
- name: model
  mountPath: /etc/moe
  readOnly: true
- name: cluster-token
  mountPath: /var/run/moe/cluster
  readOnly: true
{{- if include "moe.tlsOn" . }}
- name: tls
  mountPath: /var/run/moe/tls
  readOnly: true
{{- end }}
- name: tmp
  mountPath: /tmp
- name: checkpoint
  mountPath: /models
{{- if .Values.checkpoint.existingClaim }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* Where the services find the checkpoint. */}}
{{- define "moe.checkpointPath" -}}
{{- if and .Values.checkpoint.existingClaim .Values.checkpoint.subPath -}}
/models/{{ .Values.checkpoint.subPath }}
{{- else if .Values.checkpoint.existingClaim -}}
/models
{{- else -}}
/models/synthetic
{{- end -}}
{{- end -}}

{{/* Without a claim: an init container writes the synthetic checkpoint of the model config.
     (dict "ctx" $ "denseOnly" true "resources" ...) */}}
{{- define "moe.syntheticInit" -}}
{{- if not .ctx.Values.checkpoint.existingClaim }}
initContainers:
  - name: synthetic-checkpoint
    image: {{ include "moe.image" .ctx }}
    imagePullPolicy: {{ .ctx.Values.image.pullPolicy }}
    command: ["moe-tool"]
    args:
      - synth
      - --config
      - /etc/moe/config.json
      - --out
      - /models/synthetic
      - --seed
      - {{ .ctx.Values.checkpoint.synthetic.seed | quote }}
      - --skew
      - {{ .ctx.Values.checkpoint.synthetic.routerSkew | quote }}
      {{- if .ctx.Values.model.layers }}
      - --layers
      - {{ join "," .ctx.Values.model.layers | quote }}
      {{- end }}
      {{- if .denseOnly }}
      - --dense_only
      {{- else }}
      # this pod's expert range only (its ordinal from the host name, as expert-svc reads it)
      - --ranges_file=/etc/moe/ranges.json
      - --ordinal=-1
      {{- end }}
    {{- include "moe.containerSecurityContext" .ctx | nindent 4 }}
    volumeMounts:
      {{- include "moe.volumeMounts" .ctx | nindent 6 }}
    resources:
      {{- toYaml .resources | nindent 6 }}
{{- end }}
{{- end -}}

{{/* gRPC health probes: readiness = the server's overall status, liveness = moe.liveness. With
TLS, exec probes (`moe-cli health` over the pod's own certificate): kubelet's gRPC probe has no
TLS. */}}
{{- define "moe.probes" -}}
{{- if include "moe.tlsOn" . }}
{{- $health := printf "moe-cli health --endpoint=127.0.0.1:%v --tls_ca_file=/var/run/moe/tls/ca.crt --tls_cert_file=/var/run/moe/tls/tls.crt --tls_key_file=/var/run/moe/tls/tls.key" .Values.ports.grpc }}
startupProbe:
  exec:
    command: ["sh", "-c", {{ printf "%s --service=moe.liveness" $health | quote }}]
  periodSeconds: {{ .Values.probes.periodSeconds }}
  failureThreshold: {{ .Values.probes.startupFailureThreshold }}
livenessProbe:
  exec:
    command: ["sh", "-c", {{ printf "%s --service=moe.liveness" $health | quote }}]
  periodSeconds: {{ .Values.probes.periodSeconds }}
  failureThreshold: 3
readinessProbe:
  exec:
    command: ["sh", "-c", {{ $health | quote }}]
  periodSeconds: {{ .Values.probes.periodSeconds }}
  failureThreshold: 2
{{- else }}
startupProbe:
  grpc:
    port: {{ .Values.ports.grpc }}
    service: moe.liveness
  periodSeconds: {{ .Values.probes.periodSeconds }}
  failureThreshold: {{ .Values.probes.startupFailureThreshold }}
livenessProbe:
  grpc:
    port: {{ .Values.ports.grpc }}
    service: moe.liveness
  periodSeconds: {{ .Values.probes.periodSeconds }}
  failureThreshold: 3
readinessProbe:
  grpc:
    port: {{ .Values.ports.grpc }}
  periodSeconds: {{ .Values.probes.periodSeconds }}
  failureThreshold: 2
{{- end }}
{{- end -}}

{{/* The data plane flags and environment of attention and expert pods (values dataPlane). */}}
{{- define "moe.dataPlaneArgs" -}}
{{- $m := .Values.dataPlane.mode -}}
{{- if not (has $m (list "auto" "grpc" "ucx")) -}}
{{- fail (printf "dataPlane.mode %q must be auto, grpc or ucx" $m) -}}
{{- end -}}
- --data_plane={{ $m }}
{{- end -}}
{{- define "moe.dataPlaneEnv" -}}
- name: UCX_TLS
  value: {{ .Values.dataPlane.ucxTls | quote }}
{{- include "moe.ucxPortRange" . }}
- name: UCX_TCP_PORT_RANGE
  value: {{ printf "%d-%d" (int .Values.dataPlane.tcpPorts.first) (int .Values.dataPlane.tcpPorts.last) | quote }}
{{- end -}}
{{/* Fails unless dataPlane.tcpPorts is a range of at least 2 ports inside 1024-65535. */}}
{{- define "moe.ucxPortRange" -}}
{{- $f := int .Values.dataPlane.tcpPorts.first -}}
{{- $l := int .Values.dataPlane.tcpPorts.last -}}
{{- if or (lt $f 1024) (gt $l 65535) (lt $l (add $f 1)) -}}
{{- fail (printf "dataPlane.tcpPorts %d-%d must be a range of at least 2 ports in 1024-65535" $f $l) -}}
{{- end -}}
{{- end -}}
{{/* resources (a dict) plus the RDMA device when dataPlane.rdma.enabled. */}}
{{- define "moe.withRdma" -}}
{{- $res := deepCopy .resources -}}
{{- if .ctx.Values.dataPlane.rdma.enabled -}}
{{- $_ := set $res.limits .ctx.Values.dataPlane.rdma.resourceName (int .ctx.Values.dataPlane.rdma.count) -}}
{{- $_ := set $res.requests .ctx.Values.dataPlane.rdma.resourceName (int .ctx.Values.dataPlane.rdma.count) -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}
{{/* Pod Security "restricted": non-root (the image's user 10001), the runtime's seccomp
profile, no privilege escalation, every capability dropped, a read-only root filesystem (/tmp
is an emptyDir). RDMA needs IPC_LOCK to pin memory: with dataPlane.rdma.enabled the pods are
"baseline", not "restricted". */}}
{{- define "moe.podSecurityContext" -}}
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  fsGroup: 10001  # token and TLS files are readable by the pod's group, by nobody else
  seccompProfile:
    type: RuntimeDefault
{{- end -}}
{{- define "moe.containerSecurityContext" -}}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  runAsNonRoot: true
  capabilities:
    drop: ["ALL"]
    {{- if .Values.dataPlane.rdma.enabled }}
    add: ["IPC_LOCK"]
    {{- end }}
{{- end -}}
{{/* Pod annotations that change with the configuration, so that a config change rolls the
pods (the model ConfigMap: config.json and ranges.json). */}}
{{- define "moe.configChecksum" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap-model.yaml") . | sha256sum }}
{{- end -}}
{{- define "moe.podEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- end -}}
