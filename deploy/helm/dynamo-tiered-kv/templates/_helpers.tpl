{{/* ---------------------------------------------------------------- names and labels */}}

{{- define "dtkv.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dtkv.fullname" -}}
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

{{- define "dtkv.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "dtkv.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: dynamo
{{- end -}}

{{- define "dtkv.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dtkv.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Selects the worker pods (Deployment, StatefulSet or the DGD's worker service). */}}
{{- define "dtkv.workerSelectorLabels" -}}
{{ include "dtkv.selectorLabels" . }}
app.kubernetes.io/component: worker
{{- end -}}

{{- define "dtkv.secretName" -}}
{{- if .Values.secret.create -}}
{{- include "dtkv.fullname" . -}}
{{- else -}}
{{- required "secret.existingSecret is required when secret.create=false" .Values.secret.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "dtkv.image" -}}
{{- $repo := required "image.repository is required (an image with Dynamo's vLLM runtime and dynamo-tiered-kv)" .Values.image.repository -}}
{{- printf "%s:%s" $repo (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "dtkv.configMountPath" -}}/etc/dynamo-tiered-kv{{- end -}}

{{/* Where encryption.kekSecret is mounted; the chart points encryption_keys at it (dir://). */}}
{{- define "dtkv.kekMountPath" -}}/etc/dynamo-tiered-kv-keks{{- end -}}

{{/* ---------------------------------------------------------------- sizes */}}

{{/*
Bytes from an integer or a Kubernetes-style quantity ("32Gi", "500G", "1048576").
Returns "" for anything else (callers decide whether that is an error).
*/}}
{{- define "dtkv.bytes" -}}
{{- if kindIs "string" . -}}
{{- $units := dict "" 1 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "Pi" 1125899906842624 "K" 1000 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "P" 1000000000000000 -}}
{{- if regexMatch "^[0-9]+(Ki|Mi|Gi|Ti|Pi|K|k|M|G|T|P)?$" . -}}
{{- $num := regexFind "^[0-9]+" . -}}
{{- $unit := trimPrefix $num . -}}
{{- mul (int64 $num) (get $units $unit) -}}
{{- end -}}
{{- else if or (kindIs "float64" .) (kindIs "int64" .) (kindIs "int" .) -}}
{{- int64 . -}}
{{- end -}}
{{- end -}}

{{- define "dtkv.tpSize" -}}
{{- $tp := .Values.model.tensorParallelSize -}}
{{- if kindIs "invalid" $tp -}}{{ .Values.worker.gpus | int }}{{- else -}}{{ $tp | int }}{{- end -}}
{{- end -}}

{{- define "dtkv.ssdEnabled" -}}
{{- if ne .Values.ssd.type "none" -}}true{{- end -}}
{{- end -}}

{{/* ---------------------------------------------------------------- tiered-kv config */}}

{{/*
The TieredKVConfig mapping rendered into the ConfigMap (YAML). `forGC` drops the SSD and
metrics settings: the GC job has no SSD volume and serves no metrics.
*/}}
{{- define "dtkv.configMap" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
{{- $cfg := dict -}}
{{- range $k, $val := $v.tieredKV -}}
{{- if not (kindIs "invalid" $val) -}}{{- $_ := set $cfg $k $val -}}{{- end -}}
{{- end -}}
{{- range $k := list "host_capacity_bytes" "ssd_capacity_bytes" "ssd_segment_bytes" "object_capacity_bytes" "s3_part_bytes" "staging_slab_bytes" -}}
{{- if hasKey $cfg $k -}}
{{- $b := include "dtkv.bytes" (get $cfg $k) -}}
{{- if eq $b "" -}}{{- fail (printf "tieredKV.%s: %v is neither an integer nor a quantity like 32Gi" $k (get $cfg $k)) -}}{{- end -}}
{{- $_ := set $cfg $k ($b | int64) -}}
{{- end -}}
{{- end -}}
{{- $quotas := dict -}}
{{- if hasKey $cfg "tenant_quotas" -}}
{{- $quotas = get $cfg "tenant_quotas" -}}
{{- $_ := unset $cfg "tenant_quotas" -}}
{{- end -}}
{{- if .forGC -}}
{{- range $k := keys $cfg -}}
{{- if hasPrefix "ssd_" $k -}}{{- $_ := unset $cfg $k -}}{{- end -}}
{{- end -}}
{{- else -}}
{{- if include "dtkv.ssdEnabled" $root -}}
{{- $_ := set $cfg "ssd_dir" $v.ssd.mountPath -}}
{{- if not (hasKey $cfg "ssd_capacity_bytes") -}}
{{- $size := include "dtkv.bytes" (required "ssd.size or tieredKV.ssd_capacity_bytes is required when the SSD tier is on" $v.ssd.size) -}}
{{- if eq $size "" -}}{{- fail (printf "ssd.size: %v is not a quantity like 200Gi" $v.ssd.size) -}}{{- end -}}
{{- $per := div (mul ($size | int64) ($v.ssd.fillPercent | int64)) (mul 100 (include "dtkv.tpSize" $root | int64)) -}}
{{- $_ := set $cfg "ssd_capacity_bytes" $per -}}
{{- end -}}
{{- end -}}
{{- if $v.metrics.enabled -}}
{{- $_ := set $cfg "metrics_port" ($v.metrics.port | int) -}}
{{- end -}}
{{- with $v.encryption.kekSecret -}}
{{- $_ := set $cfg "encryption_keys" (printf "dir://%s" (include "dtkv.kekMountPath" $root)) -}}
{{- end -}}
{{- end -}}
{{- if $quotas -}}
{{- if $cfg -}}{{- toYaml $cfg -}}{{- "\n" -}}{{- end -}}
tenant_quotas: {{ include "dtkv.tenantQuotas" $quotas }}
{{- else -}}
{{- toYaml $cfg -}}
{{- end -}}
{{- end -}}

{{/*
tieredKV.tenant_quotas as a YAML flow mapping, written out here rather than by toYaml: Helm reads
every number of a values file as a float, and toYaml writes a share of 1.0 as "1", which the
settings would read as one byte. So a number up to 1 is written as a share with a decimal point
("1.0", "0.25"), 0 and larger whole numbers as bytes, a string (a size such as "40Gi") as it is.
*/}}
{{- define "dtkv.tenantQuotas" -}}
{{- $tenants := list -}}
{{- range $tenant, $limits := . -}}
{{- if not $tenant -}}{{- fail "tieredKV.tenant_quotas: an empty tenant name (write default for the default tenant)" -}}{{- end -}}
{{- $tiers := list -}}
{{- range $tier, $x := $limits -}}
{{- $text := "" -}}
{{- if kindIs "string" $x -}}
{{- $text = toJson $x -}}
{{- else if or (kindIs "float64" $x) (kindIs "int64" $x) (kindIs "int" $x) -}}
{{- $f := float64 $x -}}
{{- if and (gt $f 0.0) (le $f 1.0) -}}
{{- $text = regexReplaceAll "0+$" (printf "%.12f" $f) "" -}}
{{- if hasSuffix "." $text -}}{{- $text = print $text "0" -}}{{- end -}}
{{- else if and (ge $f 0.0) (eq $f (float64 (int64 $f))) -}}
{{- $text = toString (int64 $f) -}}
{{- end -}}
{{- end -}}
{{- if eq $text "" -}}
{{- fail (printf "tieredKV.tenant_quotas[%s][%s]: %v is neither a size like 40Gi, whole bytes, nor a share in (0, 1]" $tenant $tier $x) -}}
{{- end -}}
{{- $tiers = append $tiers (printf "%s: %s" (toJson $tier) $text) -}}
{{- end -}}
{{- $tenants = append $tenants (printf "%s: {%s}" (toJson $tenant) (join ", " $tiers)) -}}
{{- end -}}
{{- printf "{%s}" (join ", " $tenants) -}}
{{- end -}}

{{/* Our connector's kv_transfer_config entry (top level when aggregated, a MultiConnector child when not). */}}
{{- define "dtkv.tieredConnector" -}}
{{- toJson (dict "kv_connector" "TieredKVConnector" "kv_connector_module_path" "dynamo_tiered_kv.connectors.vllm" "kv_role" .Values.connector.kvRole "kv_connector_extra_config" (.Values.connector.extraConfig | default dict)) -}}
{{- end -}}

{{/*
The --kv-transfer-config JSON for vLLM. `role`: "" (aggregated: our connector alone), "prefill"
or "decode" (disaggregated: vLLM's MultiConnector over ours and NixlConnector). MultiConnector
loads from the first child that reports a hit and saves through all of them: the prefill worker
asks ours first (a stored prefix is not recomputed), the decode worker asks NIXL first (the
prefill worker's blocks arrive over NIXL; ours only answers requests that had no remote prefill).
kv_load_failure_policy is set on the MultiConnector because vLLM's scheduler reads the top level.
*/}}
{{- define "dtkv.kvTransferConfig" -}}
{{- $root := .root -}}
{{- $ours := include "dtkv.tieredConnector" $root | fromJson -}}
{{- if not .role -}}
{{- toJson $ours -}}
{{- else -}}
{{- $d := $root.Values.disaggregation -}}
{{- $nixl := dict "kv_connector" "NixlConnector" "kv_role" "kv_both" -}}
{{- with $d.nixl.extraConfig -}}{{- $_ := set $nixl "kv_connector_extra_config" . -}}{{- end -}}
{{- $children := list $ours $nixl -}}
{{- if eq .role "decode" -}}
{{- $children = list $nixl -}}
{{- if $d.decode.tieredKV -}}{{- $children = list $nixl $ours -}}{{- end -}}
{{- end -}}
{{- if eq (len $children) 1 -}}
{{- toJson $nixl -}}
{{- else -}}
{{- toJson (dict "kv_connector" "MultiConnector" "kv_role" "kv_both" "kv_load_failure_policy" "recompute" "kv_connector_extra_config" (dict "connectors" $children)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* ---------------------------------------------------------------- worker pieces */}}

{{/* Worker command: worker.command, or sglang.command for engine=sglang. */}}
{{- define "dtkv.workerCommand" -}}
{{- if eq .Values.engine "sglang" -}}{{- toYaml .Values.sglang.command -}}{{- else -}}{{- toYaml .Values.worker.command -}}{{- end -}}
{{- end -}}

{{/* SGLang's --hicache-storage-backend-extra-config: our backend (zero-copy page interface) plus connector.extraConfig. */}}
{{- define "dtkv.sglangStorageConfig" -}}
{{- $ours := dict "backend_name" "dynamo_tiered_kv" "module_path" "dynamo_tiered_kv.connectors.sglang" "class_name" "TieredHiCacheStorage" "interface_v1" 1 -}}
{{- toJson (merge $ours (.Values.connector.extraConfig | default dict)) -}}
{{- end -}}

{{/* SGLang worker args (engine=sglang; aggregated only). */}}
{{- define "dtkv.sglangWorkerArgs" -}}
{{- $v := .Values -}}
{{- $s := $v.sglang -}}
{{- $args := list "--model-path" (required "model.name is required" $v.model.name) -}}
{{- with $v.model.servedModelName -}}{{- $args = concat $args (list "--served-model-name" .) -}}{{- end -}}
{{- $tp := include "dtkv.tpSize" . -}}
{{- if ne $tp "1" -}}{{- $args = concat $args (list "--tp-size" $tp) -}}{{- end -}}
{{- $args = concat $args (list "--enable-hierarchical-cache" "--hicache-ratio" (toString $s.hicacheRatio) "--hicache-mem-layout" $s.memLayout "--hicache-write-policy" $s.writePolicy "--hicache-storage-prefetch-policy" $s.prefetchPolicy "--hicache-storage-backend" "dynamic" "--hicache-storage-backend-extra-config" (include "dtkv.sglangStorageConfig" .)) -}}
{{- $args = concat $args $v.model.extraArgs $s.extraArgs -}}
{{- toYaml $args -}}
{{- end -}}

{{/* Worker args; call with (dict "root" $ "role" ""|"prefill"|"decode"). */}}
{{- define "dtkv.workerArgs" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
{{- if eq $v.engine "sglang" -}}
{{- include "dtkv.sglangWorkerArgs" $root -}}
{{- else -}}
{{- $args := list "--model" (required "model.name is required" $v.model.name) -}}
{{- with $v.model.servedModelName -}}{{- $args = concat $args (list "--served-model-name" .) -}}{{- end -}}
{{- $tp := include "dtkv.tpSize" $root -}}
{{- if ne $tp "1" -}}{{- $args = concat $args (list "--tensor-parallel-size" $tp) -}}{{- end -}}
{{- with .role -}}{{- $args = concat $args (list "--disaggregation-mode" .) -}}{{- end -}}
{{- $args = concat $args (list "--kv-transfer-config" (include "dtkv.kvTransferConfig" .)) -}}
{{- $args = concat $args $v.model.extraArgs -}}
{{- with .role -}}{{- $args = concat $args (index $v.disaggregation . "extraArgs") -}}{{- end -}}
{{- toYaml $args -}}
{{- end -}}
{{- end -}}

{{/* Frontend args: the KV router (mode and per-tier hit weights), then frontend.args. */}}
{{- define "dtkv.frontendArgs" -}}
{{- $f := .Values.dynamoGraphDeployment.frontend -}}
{{- $args := list -}}
{{- with $f.router.mode -}}{{- $args = concat $args (list "--router-mode" .) -}}{{- end -}}
{{- if not (kindIs "invalid" $f.router.hostCacheHitWeight) -}}{{- $args = concat $args (list "--router-host-cache-hit-weight" (toString $f.router.hostCacheHitWeight)) -}}{{- end -}}
{{- if not (kindIs "invalid" $f.router.diskCacheHitWeight) -}}{{- $args = concat $args (list "--router-disk-cache-hit-weight" (toString $f.router.diskCacheHitWeight)) -}}{{- end -}}
{{- $args = concat $args $f.args -}}
{{- toYaml $args -}}
{{- end -}}

{{/* Container env: pod identity, the config file, secrets by reference, then user env. */}}
{{- define "dtkv.workerEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: DYN_TIERED_KV_CONFIG_FILE
  value: {{ include "dtkv.configMountPath" . }}/config.yaml
{{ include "dtkv.secretEnv" . }}
{{- if and .Values.worker.dynamoSystem.enabled (ne .Values.worker.kind "DynamoGraphDeployment") }}
- name: DYN_SYSTEM_ENABLED
  value: "true"
- name: DYN_SYSTEM_PORT
  value: {{ .Values.worker.dynamoSystem.port | quote }}
- name: DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS
  value: '["generate"]'
{{- end }}
{{- with .Values.model.hfTokenSecret.name }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.model.hfTokenSecret.key }}
{{- end }}
{{- with .Values.worker.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Secret env shared by the worker and the GC job. S3 keys are optional (IRSA etc.). */}}
{{- define "dtkv.secretEnv" -}}
{{- $name := include "dtkv.secretName" . -}}
- name: DYN_TIERED_KV_TENANT_SALT
  valueFrom:
    secretKeyRef:
      name: {{ $name }}
      key: {{ .Values.secret.keys.tenantSalt }}
- name: DYN_TIERED_KV_S3_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $name }}
      key: {{ .Values.secret.keys.s3AccessKey }}
      optional: true
- name: DYN_TIERED_KV_S3_SECRET_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $name }}
      key: {{ .Values.secret.keys.s3SecretKey }}
      optional: true
{{- end -}}

{{/* The SSD volume (not for volumeClaimTemplate, which the StatefulSet declares itself). */}}
{{- define "dtkv.ssdVolume" -}}
{{- $s := .Values.ssd -}}
{{- if eq $s.type "emptyDir" }}
- name: ssd
  emptyDir:
    {{- with $s.size }}
    sizeLimit: {{ . }}
    {{- end }}
{{- else if eq $s.type "hostPath" }}
- name: ssd
  hostPath:
    path: {{ $s.hostPath.path }}
    type: {{ $s.hostPath.type }}
{{- else if eq $s.type "localPV" }}
- name: ssd
  persistentVolumeClaim:
    claimName: {{ include "dtkv.fullname" . }}-ssd
{{- else if eq $s.type "existingClaim" }}
- name: ssd
  persistentVolumeClaim:
    claimName: {{ required "ssd.existingClaim is required for ssd.type=existingClaim" $s.existingClaim }}
{{- end }}
{{- end -}}

{{- define "dtkv.volumes" -}}
- name: config
  configMap:
    name: {{ include "dtkv.fullname" . }}
{{- include "dtkv.ssdVolume" . }}
{{- if and .Values.worker.shm.enabled (ne .Values.worker.kind "DynamoGraphDeployment") }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.worker.shm.size }}
{{- end }}
{{- with .Values.encryption.kekSecret }}
- name: dtkv-keks
  secret:
    secretName: {{ . }}
    defaultMode: 288  # 0440: read by the owner and the pod's fsGroup
{{- end }}
{{- if .Values.ssd.mountRunUdev }}
- name: run-udev
  hostPath:
    path: /run/udev
    type: Directory
{{- end }}
{{- with .Values.worker.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "dtkv.volumeMounts" -}}
- name: config
  mountPath: {{ include "dtkv.configMountPath" . }}
  readOnly: true
{{- if include "dtkv.ssdEnabled" . }}
- name: ssd
  mountPath: {{ .Values.ssd.mountPath }}
  {{- if and .Values.ssd.perPodSubdir (has .Values.ssd.type (list "hostPath" "localPV" "existingClaim")) }}
  subPathExpr: $(POD_NAME)
  {{- end }}
{{- end }}
{{- if and .Values.worker.shm.enabled (ne .Values.worker.kind "DynamoGraphDeployment") }}
- name: dshm
  mountPath: /dev/shm
{{- end }}
{{- if .Values.encryption.kekSecret }}
- name: dtkv-keks
  mountPath: {{ include "dtkv.kekMountPath" . }}
  readOnly: true
{{- end }}
{{- if .Values.ssd.mountRunUdev }}
- name: run-udev
  mountPath: /run/udev
  readOnly: true
{{- end }}
{{- with .Values.worker.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "dtkv.ports" -}}
{{- if and .Values.worker.dynamoSystem.enabled (ne .Values.worker.kind "DynamoGraphDeployment") }}
- name: system
  containerPort: {{ .Values.worker.dynamoSystem.port }}
  protocol: TCP
{{- end }}
{{- range $r := include "dtkv.metricsRanks" . | fromJsonArray }}
- name: {{ include "dtkv.metricsPortName" $r }}
  containerPort: {{ add $.Values.metrics.port $r }}
  protocol: TCP
{{- end }}
{{- end -}}

{{/*
TP ranks that serve metrics: every rank runs its own store in its own process and serves on
metrics.port + rank. A JSON list (empty with metrics off), for `fromJsonArray`.
*/}}
{{- define "dtkv.metricsRanks" -}}
{{- if .Values.metrics.enabled -}}{{- until (include "dtkv.tpSize" . | int) | toJson -}}{{- else -}}[]{{- end -}}
{{- end -}}

{{/*
The port name of a rank: dtkv-metrics for rank 0 (the name before per-rank ports), then
dtkv-m-<rank>. Port names are IANA_SVC_NAME: at most 15 characters (dtkv-m-99999 is 12).
*/}}
{{- define "dtkv.metricsPortName" -}}
{{- if eq (int .) 0 -}}dtkv-metrics{{- else -}}dtkv-m-{{ int . }}{{- end -}}
{{- end -}}

{{/* Pod annotations that roll the pods when the config or the created Secret changes. */}}
{{- define "dtkv.checksums" -}}
checksum/config: {{ include (print $.Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- if .Values.secret.create }}
checksum/secret: {{ include (print $.Template.BasePath "/secret.yaml") . | sha256sum }}
{{- end }}
{{- end -}}

{{/* ---------------------------------------------------------------- GC job */}}

{{/*
`dtkv gc TARGET [--endpoint URL] [--ttl SECONDS] [gc.extraArgs...]`: the CLI takes the object
store as a positional argument and its retention as --ttl (its default, 14d, is the config's
object_ttl_s default), not from the config file.
*/}}
{{- define "dtkv.gcArgs" -}}
{{- $kv := .Values.tieredKV -}}
{{- $args := list (required "gc.enabled needs tieredKV.object_url" $kv.object_url) -}}
{{- with $kv.s3_endpoint_url -}}{{- $args = concat $args (list "--endpoint" .) -}}{{- end -}}
{{- if not (kindIs "invalid" $kv.object_ttl_s) -}}
{{- $ttl := $kv.object_ttl_s -}}
{{- $text := printf "%.3f" (float64 $ttl) -}}
{{- if eq (float64 $ttl) (float64 (int64 $ttl)) -}}{{- $text = toString (int64 $ttl) -}}{{- end -}}
{{- $args = concat $args (list "--ttl" $text) -}}
{{- end -}}
{{- $args = concat $args .Values.gc.extraArgs -}}
{{- toYaml $args -}}
{{- end -}}

{{/* ---------------------------------------------------------------- checks */}}

{{/* Cross-field checks the JSON schema cannot express; fail at render time, not at 3 a.m. */}}
{{- define "dtkv.validate" -}}
{{- $v := .Values -}}
{{- $tp := include "dtkv.tpSize" . | int -}}
{{- if gt $tp ($v.worker.gpus | int) -}}
{{- fail (printf "model.tensorParallelSize (%d) needs at least that many worker.gpus (%d)" $tp ($v.worker.gpus | int)) -}}
{{- end -}}
{{- if and (eq $v.ssd.type "volumeClaimTemplate") (ne $v.worker.kind "StatefulSet") -}}
{{- fail "ssd.type=volumeClaimTemplate needs worker.kind=StatefulSet" -}}
{{- end -}}
{{- if and (eq $v.ssd.type "localPV") (not $v.ssd.localPV.nodeName) -}}
{{- fail "ssd.localPV.nodeName is required for ssd.type=localPV (the node whose NVMe holds the volume)" -}}
{{- end -}}
{{- if and (has $v.ssd.type (list "localPV" "volumeClaimTemplate")) (not $v.ssd.size) -}}
{{- fail (printf "ssd.size is required for ssd.type=%s" $v.ssd.type) -}}
{{- end -}}
{{- if and (eq $v.engine "sglang") $v.disaggregation.enabled -}}
{{- fail "engine=sglang does not support disaggregation.enabled (the chart wires SGLang workers aggregated only)" -}}
{{- end -}}
{{- $encryption := $v.tieredKV.encryption -}}
{{- if hasKey ($v.connector.extraConfig | default dict) "encryption" -}}{{- $encryption = get $v.connector.extraConfig "encryption" -}}{{- end -}}
{{- if and (eq (toString $encryption) "on") (not $v.encryption.kekSecret) -}}
{{- fail "tieredKV.encryption=\"on\" needs encryption.kekSecret: the name of an existing Secret with one key per key-encryption key version plus a key `current` naming the version in use (docs/ENCRYPTION.md); the chart mounts it and sets encryption_keys" -}}
{{- end -}}
{{- if and $v.gc.enabled (not $v.tieredKV.object_url) -}}
{{- fail "gc.enabled needs tieredKV.object_url (GC runs against the object tier)" -}}
{{- end -}}
{{- if and $v.secret.create (not $v.secret.tenantSalt) -}}
{{- fail "secret.tenantSalt is required with secret.create=true (or set secret.create=false and secret.existingSecret); it must stay the same for the life of the stored data" -}}
{{- end -}}
{{- if and $v.secret.create $v.secret.existingSecret -}}
{{- fail "set either secret.create=true or secret.existingSecret, not both" -}}
{{- end -}}
{{- if and $v.worker.shm.enabled (eq (include "dtkv.bytes" $v.worker.shm.size) "") -}}
{{- fail (printf "worker.shm.size: %v is not a quantity like 16Gi" $v.worker.shm.size) -}}
{{- end -}}
{{- if and (include "dtkv.ssdEnabled" .) $v.ssd.size (not (kindIs "invalid" $v.tieredKV.ssd_capacity_bytes)) -}}
{{- $cap := include "dtkv.bytes" $v.tieredKV.ssd_capacity_bytes -}}
{{- $size := include "dtkv.bytes" $v.ssd.size -}}
{{- if and (ne $cap "") (ne $size "") (gt (mul ($cap | int64) $tp) ($size | int64)) -}}
{{- fail (printf "tieredKV.ssd_capacity_bytes (%s per TP rank) x %d rank(s) exceeds ssd.size (%s); an emptyDir over its sizeLimit gets the pod evicted" (toString $v.tieredKV.ssd_capacity_bytes) $tp $v.ssd.size) -}}
{{- end -}}
{{- end -}}
{{- if $v.metrics.enabled -}}
{{- $first := $v.metrics.port | int -}}
{{- $last := add $first $tp -1 | int -}}
{{- $what := printf "metrics.port %d" $first -}}
{{- if gt $tp 1 -}}{{- $what = printf "metrics ports %d-%d (metrics.port + TP rank 0..%d)" $first $last (sub $tp 1) -}}{{- end -}}
{{- if gt $last 65535 -}}
{{- fail (printf "%s: port %d is above 65535; lower metrics.port" $what $last) -}}
{{- end -}}
{{- $sys := $v.worker.dynamoSystem.port | int -}}
{{- if and $v.worker.dynamoSystem.enabled (le $first $sys) (le $sys $last) -}}
{{- fail (printf "%s and worker.dynamoSystem.port %d collide: Dynamo's system server and the dtkv metrics servers need their own ports; move metrics.port" $what $sys) -}}
{{- end -}}
{{- end -}}
{{- if $v.disaggregation.enabled -}}
{{- if ne $v.worker.kind "DynamoGraphDeployment" -}}
{{- fail "disaggregation.enabled needs worker.kind=DynamoGraphDeployment (the operator wires prefill and decode workers together)" -}}
{{- end -}}
{{- if ne $v.dynamoGraphDeployment.apiVersion "nvidia.com/v1beta1" -}}
{{- fail "disaggregation.enabled needs dynamoGraphDeployment.apiVersion=nvidia.com/v1beta1" -}}
{{- end -}}
{{- end -}}
{{- include "dtkv.validateMemory" . -}}
{{- end -}}

{{/*
Memory limit check: per TP rank the store holds host_capacity_bytes of host DRAM plus its
staging slabs (package defaults 8 x 32 MiB); a memory-backed /dev/shm counts against the same
cgroup limit; plus worker.engineMemoryOverhead for the engine itself.
*/}}
{{- define "dtkv.validateMemory" -}}
{{- $v := .Values -}}
{{- $limit := "" -}}
{{- with $v.worker.resources.limits -}}{{- with .memory -}}{{- $limit = include "dtkv.bytes" . -}}{{- end -}}{{- end -}}
{{- if ne $limit "" -}}
{{- $tp := include "dtkv.tpSize" . | int64 -}}
{{- $host := 2147483648 -}}
{{- if not (kindIs "invalid" $v.tieredKV.host_capacity_bytes) -}}{{- $host = include "dtkv.bytes" $v.tieredKV.host_capacity_bytes | int64 -}}{{- end -}}
{{- $slab := 33554432 -}}
{{- if not (kindIs "invalid" $v.tieredKV.staging_slab_bytes) -}}{{- $slab = include "dtkv.bytes" $v.tieredKV.staging_slab_bytes | int64 -}}{{- end -}}
{{- $slabs := 8 -}}
{{- if not (kindIs "invalid" $v.tieredKV.staging_slabs) -}}{{- $slabs = $v.tieredKV.staging_slabs | int64 -}}{{- end -}}
{{- $shm := 0 -}}
{{- if $v.worker.shm.enabled -}}{{- $shm = include "dtkv.bytes" $v.worker.shm.size | int64 -}}{{- end -}}
{{- $over := include "dtkv.bytes" $v.worker.engineMemoryOverhead | int64 -}}
{{- $need := add (mul $tp (add $host (mul $slab $slabs))) $shm $over -}}
{{- if lt ($limit | int64) $need -}}
{{- fail (printf "worker.resources.limits.memory (%s = %s bytes) is below what the pod pins: %d TP rank(s) x (host_capacity_bytes %d + staging %d x %d) + /dev/shm %d + engineMemoryOverhead %d = %d bytes; raise the limit or lower tieredKV.host_capacity_bytes" $v.worker.resources.limits.memory $limit $tp $host $slabs $slab $shm $over $need) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* A probe from values, else the Dynamo operator's default for workers (when dynamoSystem is on). */}}
{{- define "dtkv.probe" -}}
{{- $v := .root.Values.worker -}}
{{- $given := get $v .name -}}
{{- if $given -}}
{{- toYaml $given -}}
{{- else if $v.dynamoSystem.enabled -}}
{{- $defaults := dict
  "startupProbe" (dict "httpGet" (dict "path" "/live" "port" "system") "periodSeconds" 10 "timeoutSeconds" 5 "failureThreshold" 720)
  "livenessProbe" (dict "httpGet" (dict "path" "/live" "port" "system") "periodSeconds" 10 "timeoutSeconds" 5 "failureThreshold" 3)
  "readinessProbe" (dict "httpGet" (dict "path" "/health" "port" "system") "periodSeconds" 10 "timeoutSeconds" 30 "failureThreshold" 60) -}}
{{- toYaml (get $defaults .name) -}}
{{- end -}}
{{- end -}}
