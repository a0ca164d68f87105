{{/* Names ---------------------------------------------------------------------------------------- */}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The prefix of every object's name; component names are appended, so it stays under 40 characters. */}}
{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The name of a component's objects: (dict "root" $ "component" "gateway") */}}
{{- define "tandem.componentName" -}}
{{- printf "%s-%s" (include "tandem.fullname" .root) .component -}}
{{- end -}}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tandem.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Labels ------------------------------------------------------------------------------------------ */}}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tandem
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* (dict "root" $ "component" "gateway") */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "tandem.componentLabels" -}}
{{ include "tandem.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Images ------------------------------------------------------------------------------------------ */}}

{{/* (dict "root" $ "kind" "cpu"|"cuda") */}}
{{- define "tandem.image" -}}
{{- $img := .root.Values.image -}}
{{- $repo := (index $img .kind).repository -}}
{{- $tag := default .root.Chart.AppVersion $img.tag -}}
{{- if $img.registry -}}
{{- printf "%s/%s:%s" (trimSuffix "/" $img.registry) $repo $tag -}}
{{- else -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}
{{- end -}}

{{/* Addresses: what each component is told about the others ---------------------------------------- */}}

{{- define "tandem.svcHost" -}}
{{- printf "%s.%s.svc.%s" .name .root.Release.Namespace .root.Values.clusterDomain -}}
{{- end -}}

{{- define "tandem.tokenizerAddress" -}}
{{- $name := include "tandem.componentName" (dict "root" . "component" "tokenizer") -}}
{{- printf "%s:%v" (include "tandem.svcHost" (dict "root" . "name" $name)) .Values.tokenizer.port -}}
{{- end -}}

{{- define "tandem.kvstoreAddress" -}}
{{- $name := include "tandem.componentName" (dict "root" . "component" "kvstore") -}}
{{- printf "%s:%v" (include "tandem.svcHost" (dict "root" . "name" $name)) .Values.kvstore.port -}}
{{- end -}}

{{/* The gateway's entry for a kind of worker, dns:///<headless svc>.<ns>.svc.<domain>:<port>: the gateway resolves
     it to every worker pod's IP, again every gateway.discoveryIntervalS. (dict "root" $ "component" "prefill"|"decode") */}}
{{- define "tandem.workerTarget" -}}
{{- $name := include "tandem.componentName" . -}}
{{- $values := index .root.Values .component -}}
{{- printf "dns:///%s:%v" (include "tandem.svcHost" (dict "root" .root "name" $name)) $values.port -}}
{{- end -}}

{{- define "tandem.disaggregated" -}}
{{- if eq .Values.mode "disaggregated" -}}true{{- end -}}
{{- end -}}

{{/* Redis: "in-chart", "external", "secret" or "" (the embedded in-memory index). */}}
{{- define "tandem.redisSource" -}}
{{- if include "tandem.disaggregated" . -}}
{{- if .Values.redis.enabled -}}in-chart
{{- else if .Values.redis.existingSecret -}}secret
{{- else if .Values.redis.externalUrl -}}external
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "tandem.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- $name := include "tandem.componentName" (dict "root" . "component" "redis") -}}
{{- printf "redis://%s:%v/0" (include "tandem.svcHost" (dict "root" . "name" $name)) .Values.redis.port -}}
{{- else -}}
{{- .Values.redis.externalUrl -}}
{{- end -}}
{{- end -}}

{{- define "tandem.otlpEndpoint" -}}
{{- if .Values.otelCollector.enabled -}}
{{- $name := include "tandem.componentName" (dict "root" . "component" "otel-collector") -}}
{{- printf "http://%s:4317" (include "tandem.svcHost" (dict "root" . "name" $name)) -}}
{{- else -}}
{{- .Values.telemetry.otlpEndpoint -}}
{{- end -}}
{{- end -}}

{{/* Engine -------------------------------------------------------------------------------------------- */}}

{{/* The effective engine flags of a worker kind: engine, then <component>.engine. (dict "root" $ "component" ..) */}}
{{- define "tandem.engineFlags" -}}
{{- $flags := deepCopy .root.Values.engine -}}
{{- $flags = mustMergeOverwrite $flags (deepCopy (default (dict) (index .root.Values .component).engine)) -}}
{{- toJson $flags -}}
{{- end -}}

{{/* Bytes of one KV block: layers x 2 x block size x KV heads x head dim x dtype bytes. */}}
{{- define "tandem.blockBytes" -}}
{{- if .Values.kvstore.blockBytes -}}
{{- int64 .Values.kvstore.blockBytes -}}
{{- else -}}
{{- $flags := include "tandem.engineFlags" (dict "root" . "component" "prefill") | fromJson -}}
{{- $dtypeBytes := get (dict "float32" 4 "bfloat16" 2 "float16" 2) (toString $flags.dtype) -}}
{{- if not $dtypeBytes -}}
{{- fail (printf "engine.dtype %q: set kvstore.blockBytes explicitly" (toString $flags.dtype)) -}}
{{- end -}}
{{- $m := .Values.model -}}
{{- mul (int64 $m.numLayers) 2 (int64 $flags.blockSize) (int64 $m.numKvHeads) (int64 $m.headDim) $dtypeBytes -}}
{{- end -}}
{{- end -}}

{{/* A value as text; whole numbers (YAML numbers reach templates as float64) without an exponent. */}}
{{- define "tandem.scalar" -}}
{{- if and (kindIs "float64" .) (eq . (floor .)) -}}
{{- int64 . -}}
{{- else -}}
{{- toString . -}}
{{- end -}}
{{- end -}}

{{/* TANDEM_<FLAG> entries of a ConfigMap for a map of camelCase flags; null values are left out. */}}
{{- define "tandem.flagEntries" -}}
{{- range $key, $value := . }}
{{- if not (kindIs "invalid" $value) }}
TANDEM_{{ $key | snakecase | upper }}: {{ include "tandem.scalar" $value | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Pods ---------------------------------------------------------------------------------------------- */}}

{{/* Environment every tandem container gets: who it is, where telemetry goes, UCX settings.
     (dict "root" $ "component" "gateway" "ucx" true|false) */}}
{{- define "tandem.commonEnv" -}}
{{- $root := .root -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: HOST_IP
  valueFrom:
    fieldRef:
      fieldPath: status.hostIP
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
{{- $endpoint := include "tandem.otlpEndpoint" $root }}
{{- if $endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: grpc
{{- end }}
- name: OTEL_SERVICE_NAME
  value: {{ printf "tandem-%s" .component | quote }}
{{- $attrs := list "service.namespace=tandem" "service.instance.id=$(POD_NAME)" "k8s.pod.name=$(POD_NAME)" "k8s.namespace.name=$(POD_NAMESPACE)" "k8s.node.name=$(NODE_NAME)" (printf "k8s.helm.release=%s" $root.Release.Name) }}
{{- range $k, $v := $root.Values.telemetry.resourceAttributes }}
{{- $attrs = append $attrs (printf "%s=%v" $k $v) }}
{{- end }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ join "," $attrs | quote }}
{{- with $root.Values.telemetry.extraEnv }}
{{ toYaml . }}
{{- end }}
- name: TANDEM_METRICS_PORT
  value: {{ ternary $root.Values.metrics.port -1 $root.Values.metrics.enabled | quote }}
{{- if .ucx }}
{{- $tls := ternary $root.Values.rdma.tls $root.Values.ucx.tls $root.Values.rdma.enabled }}
{{- if $tls }}
- name: UCX_TLS
  value: {{ $tls | quote }}
{{- end }}
{{- with $root.Values.ucx.netDevices }}
- name: UCX_NET_DEVICES
  value: {{ . | quote }}
{{- end }}
{{- range $k, $v := $root.Values.ucx.env }}
- name: {{ $k }}
  value: {{ $v | quote }}
{{- end }}
{{- end }}
- name: HOME
  value: /tmp
{{- end -}}

{{/* The container security context, with IPC_LOCK for UCX memory registration over RDMA. (dict "root" $ "ucx" bool) */}}
{{- define "tandem.securityContext" -}}
{{- $ctx := deepCopy .root.Values.securityContext -}}
{{- if and .ucx .root.Values.rdma.enabled .root.Values.rdma.ipcLock -}}
{{- $caps := default (dict) $ctx.capabilities -}}
{{- $_ := set $caps "add" (append (default (list) $caps.add) "IPC_LOCK") -}}
{{- $_ := set $ctx "capabilities" $caps -}}
{{- end -}}
{{- toYaml $ctx -}}
{{- end -}}

{{/* Resources with RDMA devices added for UCX users and GPUs for workers.
     (dict "root" $ "resources" map "ucx" bool "gpu" map-or-nil "memory" "10Gi"-or-"") */}}
{{- define "tandem.resources" -}}
{{- $res := deepCopy (default (dict) .resources) -}}
{{- $requests := default (dict) $res.requests -}}
{{- $limits := default (dict) $res.limits -}}
{{- if .memory -}}
{{- if not (hasKey $requests "memory") }}{{ $_ := set $requests "memory" .memory }}{{ end -}}
{{- if not (hasKey $limits "memory") }}{{ $_ := set $limits "memory" .memory }}{{ end -}}
{{- end -}}
{{- if .gpu -}}
{{- if gt (int .gpu.count) 0 -}}
{{- $_ := set $requests .gpu.resourceName (int .gpu.count) -}}
{{- $_ := set $limits .gpu.resourceName (int .gpu.count) -}}
{{- end -}}
{{- end -}}
{{- if and .ucx .root.Values.rdma.enabled -}}
{{- range $name, $count := .root.Values.rdma.resources -}}
{{- $_ := set $requests $name $count -}}
{{- $_ := set $limits $name $count -}}
{{- end -}}
{{- end -}}
{{- if $requests }}{{ $_ := set $res "requests" $requests }}{{ end -}}
{{- if $limits }}{{ $_ := set $res "limits" $limits }}{{ end -}}
{{- toYaml $res -}}
{{- end -}}

{{/* gRPC probes on grpc.health.v1.Health (overall status ""), with per-probe overrides.
     (dict "port" 50051 "probes" .Values.x.probes "startupFailures" 30 ["livenessFailures" 4]) */}}
{{- define "tandem.grpcProbes" -}}
{{- $grpc := dict "grpc" (dict "port" (int .port) "service" "") -}}
{{- $startup := merge (dict "periodSeconds" 10 "timeoutSeconds" 5 "failureThreshold" (int .startupFailures)) $grpc -}}
{{- $liveness := merge (dict "periodSeconds" 15 "timeoutSeconds" 5 "failureThreshold" (int (default 4 .livenessFailures))) (deepCopy $grpc) -}}
{{- $readiness := merge (dict "periodSeconds" 5 "timeoutSeconds" 3 "failureThreshold" 2) (deepCopy $grpc) -}}
startupProbe:
  {{- toYaml (mustMergeOverwrite $startup (default (dict) .probes.startup)) | nindent 2 }}
livenessProbe:
  {{- toYaml (mustMergeOverwrite $liveness (default (dict) .probes.liveness)) | nindent 2 }}
readinessProbe:
  {{- toYaml (mustMergeOverwrite $readiness (default (dict) .probes.readiness)) | nindent 2 }}
{{- end -}}

{{/* Scheduling of a component's pods. (dict "root" $ "component" "gateway" "values" .Values.gateway) */}}
{{- define "tandem.scheduling" -}}
{{- $v := .values -}}
{{- with $v.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if kindIs "invalid" $v.topologySpreadConstraints }}
topologySpreadConstraints:
  - maxSkew: 1
    topologyKey: kubernetes.io/hostname
    whenUnsatisfiable: ScheduleAnyway
    labelSelector:
      matchLabels:
        {{- include "tandem.selectorLabels" . | nindent 8 }}
{{- else if $v.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml $v.topologySpreadConstraints | nindent 2 }}
{{- end }}
{{- with (default .root.Values.priorityClassName $v.priorityClassName) }}
priorityClassName: {{ . }}
{{- end }}
{{- end -}}

{{/* Pod metadata annotations: config checksum, Prometheus scraping, user annotations. */}}
{{- define "tandem.podAnnotations" -}}
checksum/config: {{ include (printf "tandem.config.%s" .component) .root | sha256sum }}
{{- if and .root.Values.metrics.enabled .root.Values.metrics.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .root.Values.metrics.port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- with .root.Values.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- with .values.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "tandem.podLabels" -}}
{{ include "tandem.componentLabels" . }}
{{- with .root.Values.podLabels }}
{{ toYaml . }}
{{- end }}
{{- with .values.podLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Container ports: grpc + metrics (+ the plaintext health port when the component serves TLS).
     (dict "root" $ "port" 50051 "component" "gateway") */}}
{{- define "tandem.containerPorts" -}}
- name: grpc
  containerPort: {{ .port }}
  protocol: TCP
{{- if and .component (include "tandem.tls.server" (dict "root" .root "component" .component)) }}
- name: health
  containerPort: {{ .root.Values.tls.healthPort }}
  protocol: TCP
{{- end }}
{{- if .root.Values.metrics.enabled }}
- name: metrics
  containerPort: {{ .root.Values.metrics.port }}
  protocol: TCP
{{- end }}
{{- end -}}

{{- define "tandem.servicePorts" -}}
- name: grpc
  port: {{ .port }}
  targetPort: grpc
  protocol: TCP
{{- if .root.Values.metrics.enabled }}
- name: metrics
  port: {{ .root.Values.metrics.port }}
  targetPort: metrics
  protocol: TCP
{{- end }}
{{- end -}}

{{/* TLS ------------------------------------------------------------------------------------------------- */}}

{{/* Where the Secrets are mounted: <dir>/public (tls.crt, tls.key), <dir>/client-ca (ca.crt), <dir>/internal
     (ca.crt, tls.crt, tls.key). */}}
{{- define "tandem.tls.dir" -}}/etc/tandem/tls{{- end -}}

{{/* The Secret of a component's mutual TLS ("" when off). (dict "root" $ "component" "gateway") */}}
{{- define "tandem.tls.internalSecret" -}}
{{- $i := .root.Values.tls.internal -}}
{{- default $i.secretName (get (default (dict) $i.componentSecrets) .component) -}}
{{- end -}}

{{/* "true" when a component's gRPC port serves TLS: the gateway's with tls.public, the others' with mutual TLS.
     Such a port gets a plaintext health port next to it for the probes. (dict "root" $ "component" ..) */}}
{{- define "tandem.tls.server" -}}
{{- if eq .component "gateway" -}}
{{- if .root.Values.tls.public.secretName -}}true{{- end -}}
{{- else if include "tandem.tls.internalSecret" . -}}true
{{- end -}}
{{- end -}}

{{/* The TANDEM_TLS_* and TANDEM_HEALTH_PORT entries of a component's ConfigMap. (dict "root" $ "component" ..) */}}
{{- define "tandem.tls.config" -}}
{{- $dir := include "tandem.tls.dir" . -}}
{{- $t := .root.Values.tls -}}
{{- $internal := include "tandem.tls.internalSecret" . -}}
{{- if eq .component "gateway" }}
{{- if $t.public.secretName }}
TANDEM_TLS_CERT: {{ printf "%s/public/tls.crt" $dir | quote }}
TANDEM_TLS_KEY: {{ printf "%s/public/tls.key" $dir | quote }}
{{- if $t.public.clientCASecretName }}
TANDEM_TLS_CLIENT_CA: {{ printf "%s/client-ca/ca.crt" $dir | quote }}
{{- end }}
{{- end }}
{{- if $internal }}
TANDEM_TLS_INTERNAL_CERT: {{ printf "%s/internal/tls.crt" $dir | quote }}
TANDEM_TLS_INTERNAL_KEY: {{ printf "%s/internal/tls.key" $dir | quote }}
{{- end }}
{{- else if $internal }}
TANDEM_TLS_CERT: {{ printf "%s/internal/tls.crt" $dir | quote }}
TANDEM_TLS_KEY: {{ printf "%s/internal/tls.key" $dir | quote }}
{{- end }}
{{- if $internal }}
TANDEM_TLS_CA: {{ printf "%s/internal/ca.crt" $dir | quote }}
{{- with $t.internal.serverName }}
TANDEM_TLS_SERVER_NAME: {{ . | quote }}
{{- end }}
{{- end }}
{{- if include "tandem.tls.server" . }}
TANDEM_HEALTH_PORT: {{ $t.healthPort | quote }}
{{- end }}
{{- end -}}

{{/* The port the gRPC probes use: the plaintext health port when the gRPC port serves TLS.
     (dict "root" $ "component" .. "port" 50051) */}}
{{- define "tandem.probePort" -}}
{{- if include "tandem.tls.server" . -}}{{ .root.Values.tls.healthPort }}{{- else -}}{{ .port }}{{- end -}}
{{- end -}}

{{/* Secret volumes of a component's certificates (key files readable by the pod's group only). */}}
{{- define "tandem.tls.volumes" -}}
{{- $t := .root.Values.tls -}}
{{- $internal := include "tandem.tls.internalSecret" . -}}
{{- if and (eq .component "gateway") $t.public.secretName }}
- name: tls-public
  secret:
    secretName: {{ $t.public.secretName }}
    defaultMode: 288 # 0440
    items:
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
{{- if $t.public.clientCASecretName }}
- name: tls-client-ca
  secret:
    secretName: {{ $t.public.clientCASecretName }}
    defaultMode: 288
    items:
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- end }}
{{- if $internal }}
- name: tls-internal
  secret:
    secretName: {{ $internal }}
    defaultMode: 288
    items:
      - key: ca.crt
        path: ca.crt
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
{{- end }}
{{- end -}}

{{- define "tandem.tls.mounts" -}}
{{- $dir := include "tandem.tls.dir" . -}}
{{- $t := .root.Values.tls -}}
{{- if and (eq .component "gateway") $t.public.secretName }}
- name: tls-public
  mountPath: {{ $dir }}/public
  readOnly: true
{{- if $t.public.clientCASecretName }}
- name: tls-client-ca
  mountPath: {{ $dir }}/client-ca
  readOnly: true
{{- end }}
{{- end }}
{{- if include "tandem.tls.internalSecret" . }}
- name: tls-internal
  mountPath: {{ $dir }}/internal
  readOnly: true
{{- end }}
{{- end -}}

{{/* Model volume ------------------------------------------------------------------------------------ */}}

{{- define "tandem.modelClaimName" -}}
{{- default (include "tandem.componentName" (dict "root" . "component" "model")) .Values.model.storage.existingClaim -}}
{{- end -}}

{{- define "tandem.modelPath" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) (trimPrefix "/" .Values.model.path) -}}
{{- end -}}

{{- define "tandem.modelVolume" -}}
- name: model
{{- if eq .Values.model.storage.type "pvc" }}
  persistentVolumeClaim:
    claimName: {{ include "tandem.modelClaimName" . }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.model.storage.sizeLimit }}
{{- end }}
{{- end -}}

{{- define "tandem.modelMount" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- with .Values.model.storage.subPath }}
  subPath: {{ . }}
{{- end }}
{{- end -}}

{{/* The init container that puts the model on the volume (model.download). */}}
{{- define "tandem.modelInitContainer" -}}
{{- if .Values.model.download.enabled }}
- name: model-download
  image: {{ default (include "tandem.image" (dict "root" . "kind" "cpu")) .Values.model.download.image }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command:
    {{- toYaml .Values.model.download.command | nindent 4 }}
  env:
    - name: TANDEM_HOME
      value: {{ .Values.model.mountPath | quote }}
    - name: HOME
      value: /tmp
    {{- with .Values.model.download.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  resources:
    {{- toYaml .Values.model.download.resources | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: {{ .Values.model.mountPath }}
      {{- with .Values.model.storage.subPath }}
      subPath: {{ . }}
      {{- end }}
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end -}}

{{/* Checks that fail the install with an explanation ---------------------------------------------------- */}}

{{- define "tandem.validate" -}}
{{- if include "tandem.disaggregated" . -}}
{{- if lt (int .Values.prefill.replicas) 1 -}}
{{- fail "disaggregated mode needs prefill.replicas >= 1 (or mode: aggregated)" -}}
{{- end -}}
{{- if and (gt (int .Values.kvstore.replicas) 1) (not (include "tandem.redisSource" .)) -}}
{{- fail "kvstore.replicas > 1 needs the shared Redis index: set redis.enabled=true, redis.externalUrl or redis.existingSecret" -}}
{{- end -}}
{{- $p := include "tandem.engineFlags" (dict "root" . "component" "prefill") | fromJson -}}
{{- $d := include "tandem.engineFlags" (dict "root" . "component" "decode") | fromJson -}}
{{- if or (ne (toString $p.dtype) (toString $d.dtype)) (ne (toString $p.blockSize) (toString $d.blockSize)) -}}
{{- fail "prefill and decode must use the same engine dtype and blockSize: their KV blocks go through the kvstore" -}}
{{- end -}}
{{- end -}}
{{- if lt (int .Values.decode.replicas) 1 -}}
{{- fail "decode.replicas must be >= 1" -}}
{{- end -}}
{{- range $component := list "prefill" "decode" -}}
{{- $r := (index $.Values $component).rollingUpdate -}}
{{- if and (eq (toString $r.maxSurge) "0") (eq (toString $r.maxUnavailable) "0") -}}
{{- fail (printf "%s.rollingUpdate: maxSurge and maxUnavailable cannot both be 0 (a rollout could replace no pod)" $component) -}}
{{- end -}}
{{- end -}}
{{- $g := .Values.gateway -}}
{{- if $g.http.enabled -}}
{{- $taken := list (toString $g.port) -}}
{{- if .Values.metrics.enabled }}{{ $taken = append $taken (toString .Values.metrics.port) }}{{ end -}}
{{- if include "tandem.tls.server" (dict "root" . "component" "gateway") }}{{ $taken = append $taken (toString .Values.tls.healthPort) }}{{ end -}}
{{- if has (toString $g.http.port) $taken -}}
{{- fail (printf "gateway.http.port %v is already a port of the gateway container (gateway.port, metrics.port or tls.healthPort)" $g.http.port) -}}
{{- end -}}
{{- $servicePorts := list (toString $g.service.port) -}}
{{- if .Values.metrics.enabled }}{{ $servicePorts = append $servicePorts (toString .Values.metrics.port) }}{{ end -}}
{{- if has (toString $g.service.httpPort) $servicePorts -}}
{{- fail (printf "gateway.service.httpPort %v is already a port of the gateway Service (gateway.service.port or metrics.port)" $g.service.httpPort) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.tls.public.clientCASecretName (not .Values.tls.public.secretName) -}}
{{- fail "tls.public.clientCASecretName needs tls.public.secretName: client certificates are asked for over TLS" -}}
{{- end -}}
{{- $root := . -}}
{{- $components := include "tandem.configuredComponents" . | fromJsonArray -}}
{{- $withMtls := list -}}
{{- $without := list -}}
{{- range $components -}}
{{- if include "tandem.tls.internalSecret" (dict "root" $root "component" .) -}}
{{- $withMtls = append $withMtls . -}}
{{- else -}}
{{- $without = append $without . -}}
{{- end -}}
{{- end -}}
{{- if and $withMtls $without -}}
{{- fail (printf "mutual TLS for %s only: every component needs a certificate (tls.internal.secretName, or tls.internal.componentSecrets for %s)" (join ", " $withMtls) (join ", " $without)) -}}
{{- end -}}
{{- end -}}
