{{/* The data of each component's ConfigMap: the TANDEM_* variables of its flags. */}}

{{- define "tandem.configuredComponents" -}}
{{- if include "tandem.disaggregated" . -}}
{{- toJson (list "gateway" "tokenizer" "prefill" "decode" "kvstore") -}}
{{- else -}}
{{- toJson (list "gateway" "tokenizer" "decode") -}}
{{- end -}}
{{- end -}}

{{- define "tandem.config.gateway" -}}
TANDEM_HOST: "0.0.0.0"
TANDEM_PORT: {{ .Values.gateway.port | quote }}
TANDEM_MODE: {{ .Values.mode | quote }}
TANDEM_TOKENIZER: {{ include "tandem.tokenizerAddress" . | quote }}
{{- if include "tandem.disaggregated" . }}
TANDEM_PREFILL_WORKERS: {{ include "tandem.workerTarget" (dict "root" . "component" "prefill") | quote }}
TANDEM_KVSTORE: {{ include "tandem.kvstoreAddress" . | quote }}
{{- end }}
TANDEM_DECODE_WORKERS: {{ include "tandem.workerTarget" (dict "root" . "component" "decode") | quote }}
TANDEM_DISCOVERY_INTERVAL_S: {{ include "tandem.scalar" .Values.gateway.discoveryIntervalS | quote }}
TANDEM_MAX_INFLIGHT: {{ include "tandem.scalar" .Values.gateway.maxInflight | quote }}
TANDEM_PROBE_INTERVAL_S: {{ include "tandem.scalar" .Values.gateway.probeIntervalS | quote }}
TANDEM_MAX_PROMPT_TOKENS: {{ include "tandem.scalar" .Values.gateway.maxPromptTokens | quote }}
TANDEM_MAX_REQUEST_BYTES: {{ include "tandem.scalar" .Values.gateway.maxRequestBytes | quote }}
{{- /* -1: off, not a random port (0 would be one) */}}
TANDEM_HTTP_PORT: {{ include "tandem.scalar" (ternary .Values.gateway.http.port -1 .Values.gateway.http.enabled) | quote }}
TANDEM_HTTP_KEEPALIVE_S: {{ include "tandem.scalar" .Values.gateway.http.keepaliveS | quote }}
TANDEM_HTTP_STREAM_BUFFER: {{ include "tandem.scalar" .Values.gateway.http.streamBuffer | quote }}
{{- if .Values.gateway.apiKeys.existingSecret }}
TANDEM_API_KEYS_FILE: {{ printf "/etc/tandem/api-keys/%s" .Values.gateway.apiKeys.secretKey | quote }}
{{- end }}
{{- include "tandem.tls.config" (dict "root" . "component" "gateway") }}
{{- end -}}

{{- define "tandem.config.tokenizer" -}}
TANDEM_HOST: "0.0.0.0"
TANDEM_PORT: {{ .Values.tokenizer.port | quote }}
TANDEM_MODEL: {{ include "tandem.modelPath" . | quote }}
{{- include "tandem.tls.config" (dict "root" . "component" "tokenizer") }}
{{- end -}}

{{/* (dict "root" $ "component" "prefill"|"decode") */}}
{{- define "tandem.config.worker" -}}
{{- $v := index .root.Values .component -}}
TANDEM_HOST: "0.0.0.0"
TANDEM_PORT: {{ $v.port | quote }}
TANDEM_MODEL: {{ include "tandem.modelPath" .root | quote }}
{{- if include "tandem.disaggregated" .root }}
TANDEM_KVSTORE: {{ include "tandem.kvstoreAddress" .root | quote }}
{{- end }}
{{- if not (kindIs "invalid" $v.maxWaiting) }}
TANDEM_MAX_WAITING: {{ include "tandem.scalar" $v.maxWaiting | quote }}
{{- end }}
{{- include "tandem.flagEntries" (include "tandem.engineFlags" . | fromJson) }}
{{- include "tandem.tls.config" . }}
{{- end -}}

{{- define "tandem.config.prefill" -}}
{{- include "tandem.config.worker" (dict "root" . "component" "prefill") -}}
{{- end -}}

{{- define "tandem.config.decode" -}}
{{- include "tandem.config.worker" (dict "root" . "component" "decode") -}}
{{- end -}}

{{- define "tandem.config.kvstore" -}}
{{- $v := .Values.kvstore -}}
# TANDEM_HOST (bind and advertise) is the pod IP and TANDEM_NODE_ID the pod name: both set in the pod spec.
TANDEM_PORT: {{ $v.port | quote }}
TANDEM_DATA_PORT: {{ $v.dataPort | quote }}
TANDEM_CAPACITY_GB: {{ include "tandem.scalar" $v.capacityGb | quote }}
TANDEM_BLOCK_BYTES: {{ include "tandem.blockBytes" . | quote }}
TANDEM_HEARTBEAT_S: {{ include "tandem.scalar" $v.heartbeatS | quote }}
TANDEM_PARTIAL_TTL_S: {{ include "tandem.scalar" $v.partialTtlS | quote }}
TANDEM_RESERVE_TTL_S: {{ include "tandem.scalar" $v.reserveTtlS | quote }}
TANDEM_LEASE_TTL_S: {{ include "tandem.scalar" $v.leaseTtlS | quote }}
{{- if has (include "tandem.redisSource" .) (list "in-chart" "external") }}
TANDEM_REDIS_URL: {{ include "tandem.redisUrl" . | quote }}
{{- end }}
{{- include "tandem.tls.config" (dict "root" . "component" "kvstore") }}
{{- end -}}
