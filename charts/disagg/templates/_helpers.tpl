{{/* The chart name (nameOverride wins). */}}
{{- define "disagg.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's full name: <release>-<chart>, or just <release> when it already contains the chart name. */}}
{{- define "disagg.fullname" -}}
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

{{- define "disagg.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Selector labels. component=operator keeps the selector disjoint from the pods of the models the
operator deploys (they carry app.kubernetes.io/name=disagg and a pool component).
*/}}
{{- define "disagg.selectorLabels" -}}
app.kubernetes.io/name: {{ include "disagg.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* Labels on every object the chart creates (tests list objects by instance + managed-by). */}}
{{- define "disagg.labels" -}}
helm.sh/chart: {{ include "disagg.chart" . }}
{{ include "disagg.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: disagg
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "disagg.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "disagg.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "disagg.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/*
The operator's permissions, the same rules for the ClusterRole (all namespaces) and for each
per-namespace Role. Derived from operator/disagg_operator: apply.py (server-side apply = patch,
plus create for a new object; delete with a uid precondition when pruning), handlers.py (kopf
indices and event handlers list+watch every managed kind; kopf patches the model for its
annotations and its status subresource; kopf.info/warn post core/v1 Events) and objects/rbac.py
(the sidecar Role grants endpointslices get/list/watch; RBAC forbids granting what one does not hold).
No Secrets, no cluster-scoped objects; pods only for the planner (list, patch).
*/}}
{{- define "disagg.rbacRules" -}}
{{- include "disagg.coreRules" . }}
{{- if .Values.metrics.podMonitors.enabled }}
{{ include "disagg.monitorRules" . }}
{{- end }}
{{- if .Values.planner.enabled }}
{{ include "disagg.plannerRules" . }}
{{- end }}
{{- end -}}

{{/* PodMonitors of the models (objects/monitors.py), as every other child kind. */}}
{{- define "disagg.monitorRules" -}}
- apiGroups: ["monitoring.coreos.com"]
  resources: ["podmonitors"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
{{- end -}}

{{/* The planner (planner.py) sets replica counts through the scale subresource, and takes a prefill
pod it scales away out of the sidecars' selection first (retire.py: a label and two annotations). */}}
{{- define "disagg.plannerRules" -}}
- apiGroups: ["apps"]
  resources: ["deployments/scale"]
  verbs: ["patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "patch"]
{{- end -}}

{{- define "disagg.coreRules" -}}
- apiGroups: ["disagg.dev"]
  resources: ["disaggregatedmodels"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["disagg.dev"]
  resources: ["disaggregatedmodels/status"]
  verbs: ["get", "patch"]
- apiGroups: [""]
  resources: ["configmaps", "services", "serviceaccounts"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The engine API key Secret: created once, never read back (no get/list/watch: no Secret of the
# namespace is readable by the operator), deleted by garbage collection with its model.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}

{{/*
"true" when the operator runs as several replicas with leader election (replicas > 1): each passes
--peering=<fullname> and takes a random kopf peering priority, so only the live replica with the
highest priority reconciles and the others stand by (kopf pauses an operator while a live peer has a
higher priority). The peering object is a ClusterKopfPeering when cluster-wide, a KopfPeering in
each watched namespace when namespace-scoped (kopf's choice, by --namespace); kopf creates neither.
*/}}
{{- define "disagg.peering" -}}
{{- if gt (int .Values.replicas) 1 -}}true{{- end -}}
{{- end -}}

{{- define "disagg.peeringName" -}}
{{- include "disagg.fullname" . -}}
{{- end -}}

{{/*
The peering permissions (only with replicas > 1), for the resource given as "resource" (kopfpeerings
in each watched namespace's Role, clusterkopfpeerings in the ClusterRole): kopf lists and watches the
peering objects and merge-patches its keep-alive into the status of its own one (get/patch are
limited to that name; list/watch cannot be, kopf lists without a field selector).
*/}}
{{- define "disagg.peeringRules" -}}
- apiGroups: ["kopf.dev"]
  resources: [{{ .resource | quote }}]
  verbs: ["list", "watch"]
- apiGroups: ["kopf.dev"]
  resources: [{{ .resource | quote }}]
  resourceNames: [{{ include "disagg.peeringName" .root | quote }}]
  verbs: ["get", "patch"]
{{- end -}}

{{/* Guards for what the schema cannot express (also when --skip-schema-validation is used). */}}
{{- define "disagg.validate" -}}
{{- if or (lt (int .Values.replicas) 0) (gt (int .Values.replicas) 5) -}}
{{- fail "replicas must be between 0 and 5: one operator replica works (kopf peering leader election), the others only stand by" -}}
{{- end -}}
{{- if and .Values.metrics.serviceMonitor.enabled (not .Values.metrics.service.enabled) -}}
{{- fail "metrics.serviceMonitor.enabled needs metrics.service.enabled: the ServiceMonitor selects the metrics Service" -}}
{{- end -}}
{{- end -}}
