{{/* Labels of every object: the ones deploy/ sets, and Helm's. */}}
{{- define "kubelet-authenticator.labels" -}}
app.kubernetes.io/name: node-attestation-controller
app.kubernetes.io/part-of: kubelet-authenticator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{/* Labels of the pods, what the Deployment, Service and PDB select. */}}
{{- define "kubelet-authenticator.podLabels" -}}
app.kubernetes.io/name: node-attestation-controller
app.kubernetes.io/part-of: kubelet-authenticator
{{- end }}

{{/* The ConfigMap holding attestor-config.yaml. */}}
{{- define "kubelet-authenticator.attestorConfigMap" -}}
{{- .Values.existingAttestorConfigMap | default "node-attestation-controller-attestors" }}
{{- end }}

{{/* --attestor-config: the mounted file, or empty (no cloud attestor). */}}
{{- define "kubelet-authenticator.attestorConfigFile" -}}
{{- if or .Values.attestorConfig .Values.existingAttestorConfigMap -}}
/etc/node-attestation-controller/attestor-config.yaml
{{- end }}
{{- end }}
