{{/* Names: "<release>-infergate", or the release name when it already contains the chart's. */}}
{{- define "infergate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "infergate.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "infergate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "infergate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: {{ .Values.mode }}
{{- end -}}

{{- define "infergate.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "infergate.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "infergate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "infergate.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The InferencePool: the one this chart renders (mode epp, inferencePool.create) or an existing one. */}}
{{- define "infergate.poolName" -}}
{{- default (include "infergate.fullname" .) .Values.inferencePool.name -}}
{{- end -}}

{{/* What discovery watches: "pool", "service" or "" (no discovery). */}}
{{- define "infergate.discoveryKind" -}}
{{- if .Values.discovery.enabled -}}
{{- if eq .Values.mode "epp" -}}pool
{{- else if .Values.discovery.service -}}service
{{- else if .Values.inferencePool.name -}}pool
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The port the pods serve /metrics, /healthz and /readyz on. */}}
{{- define "infergate.httpPort" -}}
{{- if eq .Values.mode "epp" -}}{{ .Values.ports.metrics }}{{- else -}}{{ .Values.ports.http }}{{- end -}}
{{- end -}}

{{/*
The gateway configuration (gateway.Config, the YAML of `infergate serve -c`):
.Values.config with the chart's own keys laid over it — the listen addresses
from .Values.ports and discovery.kubernetes from .Values.discovery and
.Values.inferencePool (key names: CONTRACT.md of issue 17, "Discovery" and
"infergate epp").
*/}}
{{- define "infergate.config" -}}
{{- $cfg := deepCopy (.Values.config | default dict) -}}
{{- $own := dict -}}
{{- if eq .Values.mode "epp" -}}
{{- $_ := set $own "listen" (printf ":%v" .Values.ports.metrics) -}}
{{- $_ := set $own "epp" (dict "listen" (printf ":%v" .Values.ports.grpc) "health_listen" (printf ":%v" .Values.ports.health)) -}}
{{- else -}}
{{- $_ := set $own "listen" (printf "0.0.0.0:%v" .Values.ports.http) -}}
{{- end -}}
{{- $kind := include "infergate.discoveryKind" . -}}
{{- if $kind -}}
{{- $k := dict "namespace" .Release.Namespace -}}
{{- if eq $kind "pool" -}}
{{- $_ := set $k "inference_pool" (include "infergate.poolName" .) -}}
{{- else -}}
{{- $_ := set $k "service" .Values.discovery.service -}}
{{- if .Values.discovery.port -}}
{{- $_ := set $k "port" (toString .Values.discovery.port) -}}
{{- end -}}
{{- end -}}
{{- if .Values.discovery.endpoint -}}
{{- $_ := set $k "endpoint" (deepCopy .Values.discovery.endpoint) -}}
{{- end -}}
{{- $_ := set $own "discovery" (dict "kubernetes" $k) -}}
{{- end -}}
{{- $cfg = mustMergeOverwrite $cfg $own -}}
{{- if and (not $kind) (not $cfg.endpoints) -}}
{{- fail "infergate: no engines: enable discovery (mode epp, or mode serve with discovery.service or inferencePool.name) or list config.endpoints" -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}
