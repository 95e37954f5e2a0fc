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

{{/* Every router's address, a comma list (what workers register with and gateways fail over between): the
router Service for one replica, else each StatefulSet pod by its name on the headless Service. "qualified":
names that resolve from other namespaces too. */}}
{{- define "flotilla.routerAddresses" -}}
{{- $name := include "flotilla.name" .root -}}
{{- $suffix := ternary (printf ".%s.svc" .root.Release.Namespace) "" (default false .qualified) -}}
{{- $router := .root.Values.router -}}
{{- if le (int $router.replicas) 1 -}}
{{ $name }}-router{{ $suffix }}:{{ $router.port }}
{{- else -}}
{{- $addresses := list -}}
{{- range $i := until (int $router.replicas) -}}
{{- $addresses = append $addresses (printf "%s-router-%d.%s-router-headless%s:%v" $name $i $name $suffix $router.port) -}}
{{- end -}}
{{ join "," $addresses }}
{{- end -}}
{{- end -}}

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

{{/* Every worker pool the release runs, as YAML `{pools: [...]}` (read back with fromYaml): for each entry of
.Values.models, a decode pool, when that model's prefill block is enabled a prefill pool, and when its longContext
block is enabled a long-context pool (role both, named <release>-<slug>-long, with its threshold for the router).
A model's own `prefill`/`decode`/`longContext` keys override the chart-wide blocks of the same name (deep merge;
lists are replaced). Pool names are <release>-<model slug>-<role>; the slug is the model's `pool` key, else its
name made a DNS label. Each pool carries its workers' extra flags as `args`. */}}
{{- define "flotilla.pools" -}}
{{- $pools := list }}
{{- $slugs := dict }}
{{- range $model := .Values.models }}
{{- $slug := $model.pool | default (regexReplaceAll "[^a-z0-9-]+" (lower $model.name) "-" | trunc 30 | trimAll "-") }}
{{- if hasKey $slugs $slug }}{{ fail (printf "models: %q and %q share the pool name %q: give one a `pool` key" (get $slugs $slug) $model.name $slug) }}{{ end }}
{{- $_ := set $slugs $slug $model.name }}
{{- $prefill := mergeOverwrite (deepCopy $.Values.prefill) (deepCopy ($model.prefill | default dict)) }}
{{- $decode := mergeOverwrite (deepCopy $.Values.decode) (deepCopy ($model.decode | default dict)) }}
{{- range $role, $block := dict "prefill" $prefill "decode" $decode }}
{{- if $block.enabled }}
{{- $name := printf "%s-%s-%s" (include "flotilla.name" $) $slug $role }}
{{- /* the operator names the pool's Deployment and Service <pool>-workers: a DNS label, at most 63 */}}
{{- if gt (len $name) 55 }}{{ fail (printf "pool name %q is longer than 55 characters: shorten the release name or give model %q a shorter `pool` key" $name $model.name) }}{{ end }}
{{- $args := $block.extraArgs | default list }}
{{- /* the batch bound: prefill workers' steps carry no decode tokens */}}
{{- if and (hasKey $block "targetTpotMs") (ne $role "prefill") }}
{{- $args = prepend $args (printf "--target-tpot-ms=%v" $block.targetTpotMs) }}
{{- end }}
{{- $pools = append $pools (dict "name" $name "slug" $slug "role" $role
      "disaggregated" $prefill.enabled "model" $model "block" $block "args" $args) }}
{{- end }}
{{- end }}
{{- $long := mergeOverwrite (deepCopy ($.Values.longContext | default dict)) (deepCopy ($model.longContext | default dict)) }}
{{- if $long.enabled }}
{{- $name := printf "%s-%s-long" (include "flotilla.name" $) $slug }}
{{- if gt (len $name) 55 }}{{ fail (printf "pool name %q is longer than 55 characters: shorten the release name or give model %q a shorter `pool` key" $name $model.name) }}{{ end }}
{{- /* its FlotillaPool's `pool: long-context` gives its workers --pool long-context (the operator adds it) */}}
{{- $args := list "--max-num-batched-tokens" (toString (int $long.maxNumBatchedTokens)) }}
{{- if $long.kvCacheMemoryBytes }}{{ $args = concat $args (list "--kv-cache-memory-bytes" (toString (int64 $long.kvCacheMemoryBytes))) }}{{ end }}
{{- if $long.maxModelLen }}{{ $args = concat $args (list "--max-model-len" (toString (int $long.maxModelLen))) }}{{ end }}
{{- $pools = append $pools (dict "name" $name "slug" $slug "role" "long-context" "disaggregated" false
      "model" $model "block" $long "args" (concat $args ($long.extraArgs | default list))
      "threshold" (int $long.thresholdTokens)) }}
{{- end }}
{{- end }}
{{- toYaml (dict "pools" $pools) }}
{{- end -}}

{{- /* mTLS (values internalTLS): the Secret of a role's certificate, and what a container needs to use it.
A container gets FLOTILLA_TLS_DIR (its service and its exec probe read the certificate there), or, with
internalTLS.enabled false, the --insecure-internal flag. */}}
{{- define "flotilla.tlsSecret" -}}
{{ index .root.Values.internalTLS.secrets .role | default (printf "%s-tls-%s" (include "flotilla.name" .root) .role) }}
{{- end -}}

{{- /* A pool's own worker certificate Secret (cert-manager, workerIdentity pool), or "" (the release's). */}}
{{- define "flotilla.poolTlsSecret" -}}
{{- with .root.Values.internalTLS }}{{ if and .enabled .certManager.enabled (eq .certManager.workerIdentity "pool") -}}
{{ $.pool }}-tls
{{- end }}{{ end }}
{{- end -}}

{{- define "flotilla.tlsDir" -}}/etc/flotilla/tls{{- end -}}

{{- define "flotilla.tlsEnv" -}}
{{- if .Values.internalTLS.enabled -}}
- {name: FLOTILLA_TLS_DIR, value: {{ include "flotilla.tlsDir" . }}}
{{- end -}}
{{- end -}}

{{- define "flotilla.tlsArgs" -}}
{{- if not .Values.internalTLS.enabled -}}
- --insecure-internal
{{- end -}}
{{- end -}}

{{- define "flotilla.tlsMounts" -}}
{{- if .Values.internalTLS.enabled -}}
- {name: tls, mountPath: {{ include "flotilla.tlsDir" . }}, readOnly: true}
{{- end -}}
{{- end -}}

{{- define "flotilla.tlsVolumes" -}}
{{- if .root.Values.internalTLS.enabled -}}
- name: tls
  secret: {secretName: {{ include "flotilla.tlsSecret" . }}, defaultMode: 0440}
{{- end -}}
{{- end -}}

{{- /* Placement leases (values leases): the Secret the router and the operator's worker pods share, or "" (off:
the router relays every token). The router gets --lease-secret-file; the operator names it to its workers. */}}
{{- define "flotilla.leaseSecret" -}}
{{- with .Values.leases }}{{ if .enabled -}}
{{ .existingSecret | default (printf "%s-lease-secret" (include "flotilla.name" $)) }}
{{- end }}{{ end }}
{{- end -}}

{{- define "flotilla.leaseDir" -}}/etc/flotilla/leases{{- end -}}
