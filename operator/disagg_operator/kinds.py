"""Every kind of object the operator may own: one table that ordering, watching and API calls read.

Built-in kinds have a typed client class; a custom resource (``CustomObjectsApi``) is addressed by
group, version and plural instead, and its CRD may be missing from a cluster (``optional``): the
operator then reports that on the models that need it and serves every other model as usual.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Kind:
    api_version: str
    kind: str
    plural: str
    client: str  # the kubernetes client's API class
    method_suffix: str  # its methods are `<verb>_<suffix>` (patch_..., delete_...)
    optional: bool = False  # a custom resource whose CRD a cluster may not have
    # Created once when missing, then never read, watched, changed or pruned (garbage collection
    # deletes it with the model): a Secret the operator must not be able to read back.
    create_only: bool = False

    @property
    def custom(self) -> bool:
        """Addressed as (group, version, namespace, plural, name) rather than (name, namespace)."""
        return self.client == "CustomObjectsApi"

    @property
    def crd(self) -> str:
        """The CustomResourceDefinition's name, e.g. inferencepools.inference.networking.k8s.io."""
        return f"{self.plural}.{self.api_version.rpartition('/')[0]}"

    @property
    def resource(self) -> tuple[str, ...]:
        """(group, version, plural), or (version, plural) for the core group, as kopf takes them."""
        group, _, version = self.api_version.rpartition("/")
        return (group, version, self.plural) if group else (version, self.plural)


INFERENCE_POOL = Kind("inference.networking.k8s.io/v1", "InferencePool", "inferencepools", "CustomObjectsApi",
                      "namespaced_custom_object", optional=True)
POD_MONITOR = Kind("monitoring.coreos.com/v1", "PodMonitor", "podmonitors", "CustomObjectsApi",
                   "namespaced_custom_object", optional=True)

# In apply order: what a pod mounts or uses exists first.
MANAGED_KINDS: tuple[Kind, ...] = (
    Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies", "NetworkingV1Api",
         "namespaced_network_policy"),  # before any pod it guards
    Kind("v1", "Secret", "secrets", "CoreV1Api", "namespaced_secret", create_only=True),  # before pods using it
    Kind("v1", "ServiceAccount", "serviceaccounts", "CoreV1Api", "namespaced_service_account"),
    Kind("rbac.authorization.k8s.io/v1", "Role", "roles", "RbacAuthorizationV1Api", "namespaced_role"),
    Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings", "RbacAuthorizationV1Api",
         "namespaced_role_binding"),
    Kind("v1", "ConfigMap", "configmaps", "CoreV1Api", "namespaced_config_map"),
    Kind("v1", "Service", "services", "CoreV1Api", "namespaced_service"),
    Kind("apps/v1", "Deployment", "deployments", "AppsV1Api", "namespaced_deployment"),
    Kind("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers", "AutoscalingV2Api",
         "namespaced_horizontal_pod_autoscaler"),
    Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets", "PolicyV1Api",
         "namespaced_pod_disruption_budget"),
    INFERENCE_POOL,  # after the pods it selects
    POD_MONITOR,
)
WATCHED_KINDS: tuple[Kind, ...] = tuple(k for k in MANAGED_KINDS if not k.create_only)
BY_TYPE: Mapping[tuple[str, str], Kind] = {(k.api_version, k.kind): k for k in MANAGED_KINDS}
APPLY_ORDER: Mapping[str, int] = {k.kind: i for i, k in enumerate(MANAGED_KINDS)}
