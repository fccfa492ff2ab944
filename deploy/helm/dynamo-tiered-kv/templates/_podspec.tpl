{{/* Pod template shared by the Deployment and the StatefulSet. */}}
{{- define "dtkv.podTemplate" -}}
metadata:
  labels:
    {{- include "dtkv.workerSelectorLabels" . | nindent 4 }}
    {{- with .Values.worker.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    {{- include "dtkv.checksums" . | nindent 4 }}
    {{- with .Values.worker.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.worker.serviceAccountName }}
  serviceAccountName: {{ . }}
  {{- end }}
  {{- with .Values.worker.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with .Values.worker.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  terminationGracePeriodSeconds: {{ .Values.worker.terminationGracePeriodSeconds }}
  {{- with .Values.worker.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: worker
      image: {{ include "dtkv.image" . }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      command:
        {{- include "dtkv.workerCommand" . | nindent 8 }}
      args:
        {{- include "dtkv.workerArgs" (dict "root" . "role" "") | nindent 8 }}
      env:
        {{- include "dtkv.workerEnv" . | nindent 8 }}
      {{- with .Values.worker.envFrom }}
      envFrom:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with (include "dtkv.ports" . | trim) }}
      ports:
        {{- . | nindent 8 }}
      {{- end }}
      resources:
        requests:
          {{- with .Values.worker.resources.requests }}
          {{- toYaml . | nindent 10 }}
          {{- end }}
          {{ .Values.worker.gpuResource }}: {{ .Values.worker.gpus | quote }}
        limits:
          {{- with .Values.worker.resources.limits }}
          {{- toYaml . | nindent 10 }}
          {{- end }}
          {{ .Values.worker.gpuResource }}: {{ .Values.worker.gpus | quote }}
      volumeMounts:
        {{- include "dtkv.volumeMounts" . | nindent 8 }}
      {{- with .Values.worker.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- range $probe := list "startupProbe" "livenessProbe" "readinessProbe" }}
      {{- with include "dtkv.probe" (dict "root" $ "name" $probe) }}
      {{ $probe }}:
        {{- . | nindent 8 }}
      {{- end }}
      {{- end }}
  volumes:
    {{- include "dtkv.volumes" . | nindent 4 }}
  {{- with .Values.worker.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.worker.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.worker.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.worker.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}
