"""The only module that talks to the Kubernetes API (besides kopf itself).

Server-side apply with field manager ``disagg-operator`` (forced: the operator owns the fields it
sets), deletes with a uid precondition (never someone else's object of the same name), and
merge patches of the DisaggregatedModel status. Raw JSON in and out: no client model classes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from disagg_operator import names
from disagg_operator.kinds import BY_TYPE, Kind
from disagg_operator.spec import GROUP, PLURAL, VERSION

FIELD_MANAGER = names.OPERATOR
PLANNER_MANAGER = f"{names.OPERATOR}-planner"  # replica counts it sets show as this manager's
APPLY = "application/apply-patch+yaml"  # JSON is YAML: the body is sent as JSON
MERGE = "application/merge-patch+json"

SERVES_TTL = 10.0  # seconds a discovery answer is reused
NAMESPACE_TERMINATING = "NamespaceTerminating"  # the cause of a refused creation in a namespace being deleted


class ApplyError(RuntimeError):
    """The API server refused a request; ``permanent`` when retrying the same request cannot help.
    ``causes``: the reasons the refusal lists (``details.causes[].reason``)."""

    def __init__(self, message: str, status: int, causes: tuple[str, ...] = ()):
        super().__init__(message)
        self.status = status
        self.causes = causes

    @property
    def permanent(self) -> bool:
        return self.status in (400, 403, 422)

    @property
    def namespace_terminating(self) -> bool:
        """A creation refused because its namespace is being deleted (with everything in it)."""
        return NAMESPACE_TERMINATING in self.causes


def _error(exc: ApiException, what: str) -> ApplyError:
    try:
        status = json.loads(exc.body or "{}")
    except (ValueError, TypeError):
        status = {}
    status = status if isinstance(status, dict) else {}
    details = status.get("details") if isinstance(status.get("details"), dict) else {}
    causes = tuple(str(c.get("reason", "")) for c in details.get("causes") or [] if isinstance(c, dict))
    return ApplyError(f"{what}: {exc.status} {status.get('message') or exc.reason}", exc.status or 0, causes)


class KubeApi:
    def __init__(self, api_client: client.ApiClient, withheld: frozenset[Kind] = frozenset()):
        self._client = api_client
        self._apis: dict[str, Any] = {}
        self._withheld = withheld  # kinds this operator must not write (reported as not served)
        self._served: dict[Kind, tuple[float, bool]] = {}  # discovery answers, reused for SERVES_TTL

    @classmethod
    def from_environment(cls, connections: int = 32, withheld: frozenset[Kind] = frozenset()) -> KubeApi:
        """In-cluster service account, else the kubeconfig (KUBECONFIG or ~/.kube/config).

        ``connections`` should match the number of threads calling the API: a smaller pool makes
        urllib3 open (and TLS-handshake) a throwaway connection per request under load.
        """
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        configuration = client.Configuration.get_default_copy()
        configuration.connection_pool_maxsize = connections
        return cls(client.ApiClient(configuration), withheld)

    def _api(self, name: str) -> Any:
        """The client's ``name`` API (``CoreV1Api``...), made once: ``kubernetes.client`` resolves its
        names through an import under a module lock, which the handler threads would queue on."""
        if name not in self._apis:
            self._apis[name] = getattr(client, name)(self._client)
        return self._apis[name]

    def _call(self, obj: Mapping[str, Any], verb: str, *args: Any, **kwargs: Any) -> Any:
        """``<verb>_<kind's suffix>`` for ``obj``'s name and namespace (custom kinds: and group/version/plural)."""
        kind = BY_TYPE[(obj["apiVersion"], obj["kind"])]
        method = getattr(self._api(kind.client), f"{verb}_{kind.method_suffix}")
        meta = obj["metadata"]
        if kind.custom:
            group, _, version = kind.api_version.rpartition("/")
            return method(group, version, meta["namespace"], kind.plural, meta["name"], *args, **kwargs)
        return method(meta["name"], meta["namespace"], *args, **kwargs)

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply ``obj``; returns the live object."""
        meta = obj["metadata"]
        what = f"apply {obj['kind']} {meta['namespace']}/{meta['name']}"
        try:
            response = self._call(obj, "patch", dict(obj), field_manager=FIELD_MANAGER, force=True,
                                  _content_type=APPLY, _preload_content=False)
        except ApiException as exc:
            raise _error(exc, what) from None
        return json.loads(response.data)

    def create_if_missing(self, obj: Mapping[str, Any]) -> bool:
        """Create ``obj`` unless an object of its name exists (then leave that one as it is);
        whether it was created. Needs only ``create``: the object is never read back."""
        meta = obj["metadata"]
        kind = BY_TYPE[(obj["apiVersion"], obj["kind"])]
        try:
            create = getattr(self._api(kind.client), f"create_{kind.method_suffix}")
            create(meta["namespace"], dict(obj), field_manager=FIELD_MANAGER, _preload_content=False)
        except ApiException as exc:
            if exc.status == 409:  # AlreadyExists: created before (kept across reconciles)
                return False
            raise _error(exc, f"create {obj['kind']} {meta['namespace']}/{meta['name']}") from None
        return True

    def delete(self, obj: Mapping[str, Any]) -> None:
        """Delete exactly this object (uid precondition); already gone is fine."""
        meta = obj["metadata"]
        body = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=meta["uid"]),
                                      propagation_policy="Background")
        try:
            self._call(obj, "delete", body=body, _preload_content=False)
        except ApiException as exc:
            if exc.status not in (404, 409):  # 409: a newer object with that name exists; not ours to delete
                raise _error(exc, f"delete {obj['kind']} {meta['namespace']}/{meta['name']}") from None

    def serves(self, kind: Kind) -> bool:
        """Whether the API server serves ``kind`` (a custom resource's CRD is installed): API discovery,
        which every authenticated client may read. An answer is reused for ``SERVES_TTL`` seconds: every
        model converging at once asks about the same kinds (PodMonitors: every model, by default)."""
        if kind in self._withheld:
            return False
        if not kind.custom:
            return True
        cached = self._served.get(kind)
        if cached is not None and time.monotonic() - cached[0] < SERVES_TTL:
            return cached[1]
        served = self._discover(kind)
        self._served[kind] = (time.monotonic(), served)
        return served

    def _discover(self, kind: Kind) -> bool:
        group, _, version = kind.api_version.rpartition("/")
        try:
            response = self._api("CustomObjectsApi").get_api_resources(group, version, _preload_content=False)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise _error(exc, f"discover {kind.api_version}") from None
        return any(r.get("name") == kind.plural for r in json.loads(response.data).get("resources") or [])

    # --- the planner (planner.py) ---------------------------------------------------------------

    def scale(self, namespace: str, deployment: str, replicas: int) -> None:
        """Set a Deployment's replica count through its scale subresource (what `kubectl scale` does)."""
        try:
            self._api("AppsV1Api").patch_namespaced_deployment_scale(
                deployment, namespace, {"spec": {"replicas": replicas}}, field_manager=PLANNER_MANAGER,
                _content_type=MERGE, _preload_content=False)
        except ApiException as exc:
            raise _error(exc, f"scale Deployment {namespace}/{deployment}") from None

    def pods(self, namespace: str, selector: Mapping[str, str]) -> list[dict[str, Any]]:
        """The pods a label selector selects (the planner's prefill pods, ``retire.py``)."""
        try:
            response = self._api("CoreV1Api").list_namespaced_pod(
                namespace, label_selector=",".join(f"{k}={v}" for k, v in sorted(selector.items())),
                _preload_content=False)
        except ApiException as exc:
            raise _error(exc, f"list pods in {namespace}") from None
        return list(json.loads(response.data).get("items") or [])

    def patch_pod(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        """Merge-patch a pod's labels and annotations (a prefill pod leaving the sidecars' selection)."""
        try:
            self._api("CoreV1Api").patch_namespaced_pod(name, namespace, dict(patch), field_manager=PLANNER_MANAGER,
                                                        _content_type=MERGE, _preload_content=False)
        except ApiException as exc:
            if exc.status != 404:  # gone meanwhile: nothing to mark
                raise _error(exc, f"patch pod {namespace}/{name}") from None

    def service_endpoints(self, namespace: str, service: str) -> list[tuple[str, str]]:
        """(pod name, address) of the ready endpoints of a Service's EndpointSlices."""
        try:
            response = self._api("DiscoveryV1Api").list_namespaced_endpoint_slice(
                namespace, label_selector=f"kubernetes.io/service-name={service}", _preload_content=False)
        except ApiException as exc:
            raise _error(exc, f"list EndpointSlices of {namespace}/{service}") from None
        out = []
        for item in json.loads(response.data).get("items") or []:
            for endpoint in item.get("endpoints") or []:
                if (endpoint.get("conditions") or {}).get("ready") is False or not endpoint.get("addresses"):
                    continue
                pod = (endpoint.get("targetRef") or {}).get("name") or endpoint["addresses"][0]
                out.append((pod, endpoint["addresses"][0]))
        return out

    def hpa_targets(self, namespace: str) -> dict[str, str]:
        """Deployment name → the HorizontalPodAutoscaler scaling it, for the namespace's HPAs."""
        try:
            response = self._api("AutoscalingV2Api").list_namespaced_horizontal_pod_autoscaler(
                namespace, _preload_content=False)
        except ApiException as exc:
            raise _error(exc, f"list HorizontalPodAutoscalers in {namespace}") from None
        out = {}
        for item in json.loads(response.data).get("items") or []:
            ref = (item.get("spec") or {}).get("scaleTargetRef") or {}
            if ref.get("kind") == "Deployment" and ref.get("name"):
                out[ref["name"]] = item["metadata"]["name"]
        return out

    def model_exists(self, namespace: str, name: str, uid: str) -> bool:
        """Whether this very DisaggregatedModel (same uid) still exists."""
        try:
            response = self._api("CustomObjectsApi").get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, _preload_content=False)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise _error(exc, f"get {namespace}/{name}") from None
        return json.loads(response.data)["metadata"]["uid"] == uid

    def patch_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        """Merge-patch the DisaggregatedModel's status subresource."""
        try:
            self._api("CustomObjectsApi").patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, PLURAL, name, {"status": dict(patch)}, field_manager=FIELD_MANAGER,
                _content_type=MERGE, _preload_content=False,
            )
        except ApiException as exc:
            if exc.status != 404:  # deleted meanwhile: nothing to report on
                raise _error(exc, f"patch status of {namespace}/{name}") from None
