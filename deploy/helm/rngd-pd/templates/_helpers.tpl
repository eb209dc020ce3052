{{/* Names */}}
{{- define "rngd-pd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rngd-pd.fullname" -}}
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

{{- define "rngd-pd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rngd-pd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rngd-pd.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "rngd-pd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rngd-pd
{{- end -}}

{{- define "rngd-pd.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The KV relay's address every serving pod gets as AIRM_KV_TCP_ADDR ("" when none). */}}
{{- define "rngd-pd.relayAddr" -}}
{{- if .Values.airm.kvTcpAddr -}}
{{- .Values.airm.kvTcpAddr -}}
{{- else if .Values.kvRelay.enabled -}}
{{- printf "%s-kv-relay.%s.svc:%d" (include "rngd-pd.fullname" .) .Release.Namespace (int .Values.kvRelay.port) -}}
{{- end -}}
{{- end -}}

{{- define "rngd-pd.relaySecretName" -}}
{{- default (printf "%s-kv-relay" (include "rngd-pd.fullname" .)) .Values.kvRelay.secret.name -}}
{{- end -}}

{{/* Does the transport go through a relay? */}}
{{- define "rngd-pd.usesRelay" -}}
{{- if has .Values.airm.kvTransport (list "tcp" "nixl-ucx") -}}true{{- end -}}
{{- end -}}

{{- define "rngd-pd.prefillGrpcPort" -}}
{{- if kindIs "invalid" .Values.prefill.grpcPort -}}{{ int .Values.ports.grpc }}{{- else -}}{{ int .Values.prefill.grpcPort }}{{- end -}}
{{- end -}}

{{- define "rngd-pd.poolTargetPort" -}}
{{- if kindIs "invalid" .Values.inferencePool.targetPort -}}{{ int .Values.ports.openai }}{{- else -}}{{ int .Values.inferencePool.targetPort }}{{- end -}}
{{- end -}}

{{/*
The tritonserver --model-config-name for a role: the role's configName, else from its device.
prefill: rngd -> default (config.pbtxt, the production binding: serve never probes nor falls back),
others -> the device name. decode: atom -> default, rngd -> rngd (configs/rngd.pbtxt), others -> the
device name.
*/}}
{{- define "rngd-pd.configName" -}}
{{- $role := index . 0 -}}{{- $spec := index . 1 -}}
{{- if $spec.configName -}}
{{- $spec.configName -}}
{{- else if and (eq $role "prefill") (ne $spec.device "rngd") -}}
{{- $spec.device -}}
{{- else if and (eq $role "decode") (ne $spec.device "atom") -}}
{{- $spec.device -}}
{{- else if or (eq $role "prefill") (eq $role "decode") -}}
default
{{- end -}}
{{- end -}}

{{- /*
The prefill pods' `rngd-pd serve --kv-events-config` (vLLM's KVEventsConfig keys, docs/kv-events.md):
PUB bound on every interface of the pod, the replay ROUTER beside it, topic kv@<pod IP>@<model>
($(POD_IP) is expanded by the kubelet from the container's env).
*/ -}}
{{- define "rngd-pd.kvEventsConfig" -}}
{{- $c := dict "enable_kv_cache_events" true "publisher" "zmq" "endpoint" (printf "tcp://*:%d" (int .Values.kvEvents.port)) "buffer_steps" (int .Values.kvEvents.bufferSteps) "topic" (printf "kv@$(POD_IP)@%s" .Values.model.name) -}}
{{- if .Values.kvEvents.replayPort }}{{- $_ := set $c "replay_endpoint" (printf "tcp://*:%d" (int .Values.kvEvents.replayPort)) -}}{{- end -}}
{{- toJson $c -}}
{{- end -}}
