{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "inflight.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release full name: the release name, suffixed with the chart name unless it already holds it. */}}
{{- define "inflight.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* Labels that select the operator pods; never change them in an upgrade. */}}
{{- define "inflight.selectorLabels" -}}
app.kubernetes.io/name: {{ include "inflight.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* The Kubernetes recommended labels on every object of the release. */}}
{{- define "inflight.labels" -}}
{{ include "inflight.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: inflight
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{- define "inflight.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "inflight.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name must name an existing ServiceAccount when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* repository:tag or repository@digest; call with (dict "image" .Values.image "appVersion" .Chart.AppVersion). */}}
{{- define "inflight.image" -}}
{{- if .image.digest }}
{{- printf "%s@%s" .image.repository .image.digest }}
{{- else }}
{{- printf "%s:%s" .image.repository (default .appVersion .image.tag) }}
{{- end }}
{{- end }}

{{/* The `inflight operator` command line (after the image's `inflight operator` entrypoint). */}}
{{- define "inflight.operatorArgs" -}}
{{- if and (not .Values.leaderElection.enabled) (gt (int .Values.replicaCount) 1) }}
{{- fail "leaderElection.enabled=false needs replicaCount 1: replicas without leader election reconcile the same ModelServers" }}
{{- end }}
{{- range .Values.watchNamespaces }}
- --namespace={{ . }}
{{- else }}
- --all-namespaces
{{- end }}
{{- if not .Values.leaderElection.enabled }}
- --no-leader-election
{{- end }}
- --liveness=http://0.0.0.0:{{ .Values.healthPort }}/healthz
- --metrics-address=0.0.0.0:{{ .Values.metricsPort }}
- --resync-seconds={{ .Values.resyncSeconds }}
- --autoscale-seconds={{ .Values.builtinAutoscaling.intervalSeconds }}
- --scrape-timeout-seconds={{ .Values.builtinAutoscaling.scrapeTimeoutSeconds }}
{{- if .Values.verbose }}
- --verbose
{{- end }}
{{- end }}

{{/* Labels on the ModelServer server pods the operator creates (inflight/operator/children/server.py). */}}
{{- define "inflight.serverPodSelector" -}}
app.kubernetes.io/name: inflight-server
app.kubernetes.io/managed-by: inflight-operator
{{- end }}

{{/* The monitoring objects' labels: the release's plus the ones the user's Prometheus selects on. */}}
{{- define "inflight.monitoringLabels" -}}
{{ include "inflight.labels" .root }}
{{- with .extra }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels that select the router pods. */}}
{{- define "inflight.routerSelectorLabels" -}}
app.kubernetes.io/name: inflight-router
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: router
{{- end }}

{{/* The recommended labels on the router's objects. */}}
{{- define "inflight.routerLabels" -}}
{{ include "inflight.routerSelectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: inflight
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}
