{{/* The chart's name, at most 63 characters. */}}
{{- define "shoal.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's full name, at most 63 characters (Kubernetes' limit for a label value and a DNS name). */}}
{{- define "shoal.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "shoal.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The labels every object of the release carries. */}}
{{- define "shoal.labels" -}}
helm.sh/chart: {{ include "shoal.chart" . }}
{{ include "shoal.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: shoal
{{- end }}

{{/* The labels the server's Service and Deployment select on (never change across upgrades). */}}
{{- define "shoal.selectorLabels" -}}
app.kubernetes.io/name: {{ include "shoal.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: server
{{- end }}

{{- define "shoal.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "shoal.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The server's image reference. */}}
{{- define "shoal.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The image the Kubernetes executor starts tasks from. */}}
{{- define "shoal.workerImage" -}}
{{- default (include "shoal.image" .) .Values.workerImage }}
{{- end }}

{{/* The name of the claim holding the server's state. */}}
{{- define "shoal.stateClaim" -}}
{{- default (printf "%s-state" (include "shoal.fullname" .)) .Values.persistence.existingClaim }}
{{- end }}

{{/* PostgreSQL run by the chart: its name (StatefulSet, Service, Secret) and labels. */}}
{{- define "shoal.postgresql.fullname" -}}
{{- printf "%s-postgresql" (include "shoal.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "shoal.postgresql.selectorLabels" -}}
app.kubernetes.io/name: {{ include "shoal.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: postgresql
{{- end }}

{{- define "shoal.postgresql.labels" -}}
helm.sh/chart: {{ include "shoal.chart" . }}
{{ include "shoal.postgresql.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.postgresql.image.tag | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: shoal
{{- end }}

{{/* The Secret and key holding the database URL, or nothing for SQLite. */}}
{{- define "shoal.databaseSecret" -}}
{{- if .Values.postgresql.enabled }}
{{- include "shoal.postgresql.fullname" . }}
{{- else }}
{{- .Values.database.existingSecret }}
{{- end }}
{{- end }}

{{- define "shoal.databaseSecretKey" -}}
{{- if .Values.postgresql.enabled }}url{{ else }}{{ .Values.database.secretKey }}{{ end }}
{{- end }}

{{/* Refuses values that contradict each other. */}}
{{- define "shoal.validate" -}}
{{- if not (has .Values.executor (list "kubernetes" "local")) }}
{{- fail (printf "executor must be kubernetes or local, not %q" (toString .Values.executor)) }}
{{- end }}
{{- if and .Values.postgresql.enabled .Values.database.existingSecret }}
{{- fail "postgresql.enabled and database.existingSecret both name a database: choose one" }}
{{- end }}
{{- if and (eq .Values.executor "kubernetes") (not .Values.rbac.create) (not .Values.serviceAccount.name) }}
{{- fail "executor kubernetes needs rbac.create, or serviceAccount.name naming an account that may manage pods" }}
{{- end }}
{{- if and (eq .Values.executor "kubernetes") (not .Values.persistence.enabled) }}
{{- fail "executor kubernetes needs persistence.enabled: the workers' Pods mount the state volume" }}
{{- end }}
{{- if and .Values.postgresql.auth.password (not (regexMatch "^[A-Za-z0-9]+$" .Values.postgresql.auth.password)) }}
{{- fail "postgresql.auth.password: letters and digits only (it is written into the database URL)" }}
{{- end }}
{{- end }}
