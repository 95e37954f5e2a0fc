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

{{/* The gateway's --redis-url; "" without Redis. Credentials come from Secrets through env vars
(flotilla.redisEnv), expanded by the kubelet: they are in neither the pod spec nor a ConfigMap. */}}
{{- define "flotilla.redisUrl" -}}
{{- if .Values.redis.enabled -}}redis://:$(REDIS_PASSWORD)@{{ include "flotilla.name" . }}-redis:6379/0
{{- else if .Values.redis.urlSecret -}}$(FLOTILLA_REDIS_URL)
{{- else -}}{{ .Values.redis.url }}{{- end -}}
{{- end -}}

{{- define "flotilla.redisEnv" -}}
{{- if .Values.redis.enabled }}
- name: REDIS_PASSWORD
  valueFrom: {secretKeyRef: {name: {{ .Values.redis.auth.existingSecret }}, key: {{ .Values.redis.auth.key }}}}
{{- else if .Values.redis.urlSecret }}
- name: FLOTILLA_REDIS_URL
  valueFrom: {secretKeyRef: {name: {{ .Values.redis.urlSecret }}, key: url}}
{{- end }}
{{- end -}}

{{/* Pod hardening, the same in every pod (the operator's worker pods too: operator/manifests.py). The argument
is the uid/gid the image runs as (Flotilla's image: 10001). */}}
{{- define "flotilla.podSecurityContext" -}}
securityContext:
  runAsNonRoot: true
  runAsUser: {{ . }}
  runAsGroup: {{ . }}
  fsGroup: {{ . }}
  seccompProfile: {type: RuntimeDefault}
{{- end -}}

{{- define "flotilla.containerSecurityContext" -}}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities: {drop: [ALL]}
{{- end -}}

{{/* The only paths a Flotilla container writes on its read-only root filesystem: scratch and the caches
(Dockerfile: FLOTILLA_CACHE, XDG_CACHE_HOME, HF_HOME, TRITON_CACHE_DIR). */}}
{{- define "flotilla.writableMounts" -}}
- {name: tmp, mountPath: /tmp}
- {name: cache, mountPath: /var/cache/flotilla}
{{- end -}}

{{- define "flotilla.writableVolumes" -}}
- {name: tmp, emptyDir: {}}
- {name: cache, emptyDir: {}}
{{- end -}}
