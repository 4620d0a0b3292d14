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

{{/* Non-empty in standalone mode. */}}
{{- define "kubelet-authenticator.standalone" -}}
{{- if eq .Values.mode "standalone" }}true{{ end }}
{{- end }}

{{/*
The combinations of values that cannot work, each refused with the value to
change (values.schema.json checks each value on its own).
*/}}
{{- define "kubelet-authenticator.validate" -}}
{{- $s := .Values.standalone }}
{{- if include "kubelet-authenticator.standalone" . }}
{{- range $key := list "caSecret" "allowlistConfigMap" "servingCASecret" }}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$" (get $s $key)) }}
{{- fail (printf "standalone.%s: %q is not the name of an object in the release namespace (%s): the controller is granted only that namespace, so give a name, not namespace/name" $key (get $s $key) $.Release.Namespace) }}
{{- end }}
{{- end }}
{{- if eq $s.caSecret $s.servingCASecret }}
{{- fail (printf "standalone.servingCASecret must differ from standalone.caSecret (both %q): the controller writes its serving CAs into servingCASecret" $s.caSecret) }}
{{- end }}
{{- if or (eq $s.caSecret "node-attestation-controller-tpm-key") (eq $s.servingCASecret "node-attestation-controller-tpm-key") }}
{{- fail "standalone.caSecret and standalone.servingCASecret must not be node-attestation-controller-tpm-key, the Secret of the TPM attestor's challenge key" }}
{{- end }}
{{- range $p, $doc := $s.attestorPolicies }}
{{- if not (has $p $s.authorizedAttestors) }}
{{- fail (printf "standalone.attestorPolicies.%s: attestor %s is not in standalone.authorizedAttestors" $p $p) }}
{{- end }}
{{- end }}
{{- range $s.authorizedAttestors }}
{{- if and (has . (list "aws" "azure" "gcp")) (not (hasKey $.Values.attestorConfig .)) (not $.Values.existingAttestorConfigMap) }}
{{- fail (printf "standalone.authorizedAttestors names %s, which has no configuration: set attestorConfig.%s (or existingAttestorConfigMap)" . .) }}
{{- end }}
{{- end }}
{{- if or .Values.sharding.enabled .Values.watchFilter }}
{{- fail "sharding.enabled and watchFilter apply only with mode: capi: standalone mode serves the one cluster it runs in" }}
{{- end }}
{{- else }}
{{- if or $s.lockdown $s.approveKubeletServing $s.revocationPeriod $s.attestorPolicies }}
{{- fail "standalone.lockdown, standalone.approveKubeletServing, standalone.revocationPeriod and standalone.attestorPolicies apply only with mode: standalone; Cluster API mode takes lockdown, approveKubeletServing and policies from each Cluster's ClusterAttestation spec (docs/install.md) and revokes a node when its Machine is deleted" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Where the attestor policy documents are mounted (mode: standalone). */}}
{{- define "kubelet-authenticator.policyDir" -}}
/etc/node-attestation-controller-policies
{{- end }}
