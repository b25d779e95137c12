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
- --server-image={{ include "inflight.image" (dict "image" .Values.serverImage "appVersion" .Chart.AppVersion) }}
- --health-port={{ .Values.healthPort }}
- --log-level={{ .Values.logLevel }}
{{- if .Values.leaderElection.enabled }}
- --leader-election
{{- end }}
{{- end }}
