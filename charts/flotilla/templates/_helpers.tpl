{{- define "flotilla.name" -}}{{ .Release.Name | trunc 40 | trimSuffix "-" }}{{- end -}}

{{- define "flotilla.labels" -}}
app.kubernetes.io/name: flotilla
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "flotilla.selector" -}}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "flotilla.image" -}}{{ printf "%s:%s" .repository .tag }}{{- end -}}

{{- define "flotilla.routerAddress" -}}{{ include "flotilla.name" . }}-router:{{ .Values.router.port }}{{- end -}}

{{- define "flotilla.redisUrl" -}}
{{- if .Values.redis.enabled -}}redis://{{ include "flotilla.name" . }}-redis:6379/0{{- else -}}{{ .Values.redis.url }}{{- end -}}
{{- end -}}
