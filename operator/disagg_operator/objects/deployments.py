"""One Deployment per active pool; decode pods also run the routing sidecar in front of vLLM."""

from __future__ import annotations

import math
from typing import Any

from disagg_operator import engine_args, names
from disagg_operator.names import Role
from disagg_operator.plan import Plan
from disagg_operator.pool_plan import MODEL_MOUNT_ROOT, PoolPlan
from disagg_operator.sidecar_config import CLIENT_KEY_DIR, ENGINE_KEY_DIR
from disagg_sidecar import wire
from disagg_sidecar.config import SERVICE_ACCOUNT_DIR

SIDECAR_CONFIG_DIR = "/etc/disagg"
SIDECAR_CONFIG_FILE = "sidecar.yaml"
SIDECAR_COMMAND = ["disagg", "sidecar", "--config", f"{SIDECAR_CONFIG_DIR}/{SIDECAR_CONFIG_FILE}"]
CACHE_DIR = "/var/cache/disagg"  # writable (emptyDir or engine.cacheClaim): HOME of the engines, so the HF,
TMP_DIR = "/tmp"  # vLLM, Triton, CUDA and FlashInfer caches under ~ land on it; /tmp: torch compile, vLLM IPC
NON_ROOT_UID = 1000
DEFAULT_SIDECAR_RESOURCES = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}
# A refused connection costs nothing while vLLM loads; a short period lets a pod go Ready about
# when its engine does (a 10 s period waited 5 s on average after every start).
STARTUP_PERIOD = 2
DECODE_GRACE_SECONDS = 120  # lets streams in flight finish when a decode pod is replaced (> stop_seconds)

# Every container (engines of all pools, the sidecar): non-root, no privilege escalation, no
# capabilities, a read-only root; what vLLM writes goes to volumes (cache: emptyDir or engine.cacheClaim; tmp, dshm).
_RESTRICTED = {
    "runAsNonRoot": True, "runAsUser": NON_ROOT_UID, "runAsGroup": NON_ROOT_UID,
    "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
    "readOnlyRootFilesystem": True, "seccompProfile": {"type": "RuntimeDefault"},
}
_POD_SECURITY = {"runAsNonRoot": True, "fsGroup": NON_ROOT_UID, "fsGroupChangePolicy": "OnRootMismatch",
                 "seccompProfile": {"type": "RuntimeDefault"}}


def _probe(path: str, port: str, period: int, failures: int, timeout: int = 3, https: bool = False) -> dict[str, Any]:
    get = {"path": path, "port": port, **({"scheme": "HTTPS"} if https else {})}  # the kubelet verifies no cert
    return {"httpGet": get, "periodSeconds": period, "failureThreshold": failures, "timeoutSeconds": timeout}


def pre_stop(plan: Plan, pool: PoolPlan) -> dict[str, Any] | None:
    """What vLLM's preStop hook waits for (kubelet signals every container of a terminating pod
    at once): a decode engine until its sidecar has drained (the sidecar's ``/health/drained``
    answers then, ``limits.stop_seconds`` at most: an idle pod goes after the deregister window);
    the others for the sidecars' ``limits.deregister_seconds``, until their Services and the
    sidecars' EndpointSlice watches have dropped the pod (the same delay, seen from the other side).
    No shell in the image needed: an HTTP GET (to the port number: kubelet resolves a hook's named
    port against its own container's ports) and a sleep action."""
    if pool.role == Role.DECODE:
        return {"httpGet": {"path": wire.DRAINED, "port": plan.sidecar.port}}
    if seconds := math.ceil(plan.sidecar.config.limits.deregister_seconds):
        return {"sleep": {"seconds": seconds}}
    return None


def _vllm_container(plan: Plan, pool: PoolPlan) -> dict[str, Any]:
    ports = [{"name": names.ENGINE_PORT, "containerPort": pool.port, "protocol": "TCP"}]
    ports += [{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in plan.side_channel_ports(pool)]
    env = [e.to_k8s() for e in pool.env]
    # The non-root user has no home directory (and the root is read-only): HOME is the cache volume.
    # A user's own value wins (a container's env is keyed by name: no duplicates).
    env += [e for e in ({"name": "HOME", "value": CACHE_DIR}, {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"})
            if e["name"] not in {v.name for v in pool.env}]
    mounts = [{"name": "cache", "mountPath": CACHE_DIR}, {"name": "tmp", "mountPath": TMP_DIR}]
    if pool.uses_chat_template and plan.chat_template:
        mounts.append({"name": "chat-template", "mountPath": plan.chat_template.path.rsplit("/", 1)[0],
                       "readOnly": True})
    if plan.model.claim:
        mounts.append({"name": "model", "mountPath": f"{MODEL_MOUNT_ROOT}/{plan.model.claim}", "readOnly": True})
    if pool.kv_shared_path:
        mounts.append({"name": "kv-shared", "mountPath": pool.kv_shared_path})
    if pool.gpu:
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})  # NCCL/TP workers need more than 64Mi
    https = plan.spec.security.tls is not None
    if https:
        mounts.append({"name": "engine-tls", "mountPath": engine_args.TLS_DIR, "readOnly": True})
    container: dict[str, Any] = {
        "name": names.VLLM_CONTAINER,
        "image": pool.image,
        "command": engine_args.launcher_argv(pool.launcher),
        "args": pool.server_args(plan.model),
        "ports": ports,
        "env": env,
        "volumeMounts": mounts,
        "startupProbe": _probe(pool.health_path, names.ENGINE_PORT, STARTUP_PERIOD,
                               max(1, pool.startup_seconds // STARTUP_PERIOD), https=https),
        "readinessProbe": _probe(pool.health_path, names.ENGINE_PORT, 5, 3, https=https),
        "livenessProbe": _probe(pool.health_path, names.ENGINE_PORT, 10, 6, timeout=5, https=https),
    }
    if hook := pre_stop(plan, pool):
        container["lifecycle"] = {"preStop": hook}
    if pool.image_pull_policy:
        container["imagePullPolicy"] = pool.image_pull_policy
    if pool.resources:
        container["resources"] = dict(pool.resources)
    container["securityContext"] = dict(_RESTRICTED)
    return container


def _sidecar_container(plan: Plan) -> dict[str, Any]:
    sidecar = plan.sidecar
    mounts = [{"name": "sidecar-config", "mountPath": SIDECAR_CONFIG_DIR, "readOnly": True}]
    if plan.disaggregated:  # prefill discovery reads EndpointSlices; only this container gets a token
        mounts.append({"name": "api-token", "mountPath": SERVICE_ACCOUNT_DIR, "readOnly": True})
    mounts += [{"name": volume, "mountPath": path, "readOnly": True} for volume, path, _, _ in _sidecar_secrets(plan)]
    container: dict[str, Any] = {
        "name": names.SIDECAR_CONTAINER,
        "image": sidecar.image,
        "command": list(SIDECAR_COMMAND),
        "ports": [{"name": names.HTTP_PORT, "containerPort": sidecar.port, "protocol": "TCP"}],
        "volumeMounts": mounts,
        "readinessProbe": _probe(sidecar.health_path, names.HTTP_PORT, 5, 3),
        "resources": dict(sidecar.resources or DEFAULT_SIDECAR_RESOURCES),
        "securityContext": dict(_RESTRICTED),
    }
    if plan.spec.engine.image_pull_policy:
        container["imagePullPolicy"] = plan.spec.engine.image_pull_policy
    return container


def _sidecar_secrets(plan: Plan) -> list[tuple[str, str, str, dict[str, str]]]:
    """The Secrets mounted into the sidecar only: (volume, mount path, Secret, Secret key -> file).
    Each API key is the file ``api-key`` (sidecar_config.auth); of TLS, the CA only: the sidecar
    never sees the engines' private key."""
    security, out = plan.spec.security, []
    if security.engine_api_key.enabled:
        out.append(("engine-api-key", ENGINE_KEY_DIR, names.engine_api_key_secret(plan.name),
                    {names.API_KEY_KEY: names.API_KEY_KEY}))
    if (client := security.client_api_key) is not None:
        out.append(("client-api-key", CLIENT_KEY_DIR, client.name, {client.key: names.API_KEY_KEY}))
    if security.tls is not None:
        out.append(("engine-tls-ca", engine_args.TLS_CA_DIR, security.tls.secret_name, {"ca.crt": "ca.crt"}))
    return out


def _secret_volume(volume: str, secret: str, files: dict[str, str]) -> dict[str, Any]:
    """``files``: Secret key -> file name. 0440 with fsGroup: the pod's non-root containers read it, nobody else."""
    return {"name": volume, "secret": {"secretName": secret, "defaultMode": 0o440,
                                       "items": [{"key": k, "path": p} for k, p in files.items()]}}


def _volumes(plan: Plan, pool: PoolPlan) -> list[dict[str, Any]]:
    cache = {"persistentVolumeClaim": {"claimName": pool.cache_claim}} if pool.cache_claim else {"emptyDir": {}}
    volumes: list[dict[str, Any]] = [{"name": "cache", **cache}, {"name": "tmp", "emptyDir": {}}]
    template = plan.chat_template
    if pool.uses_chat_template and template:
        filename = template.path.rsplit("/", 1)[1]
        source = (template.config_map, template.key) if template.config_map else (
            names.config_map(plan.name), filename)
        volumes.append({"name": "chat-template", "configMap": {
            "name": source[0], "items": [{"key": source[1], "path": filename}]}})
    if plan.model.claim:
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": plan.model.claim, "readOnly": True}})
    if pool.kv_shared_claim:
        volumes.append({"name": "kv-shared", "persistentVolumeClaim": {"claimName": pool.kv_shared_claim}})
    elif pool.kv_shared_path:  # the root is read-only; KV stays in the pod (no claim to share it)
        volumes.append({"name": "kv-shared", "emptyDir": {}})
    if pool.gpu:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    if (tls := plan.spec.security.tls) is not None:
        volumes.append(_secret_volume("engine-tls", tls.secret_name, {"tls.crt": "tls.crt", "tls.key": "tls.key"}))
    if pool.role == Role.DECODE:
        volumes.append({"name": "sidecar-config", "configMap": {
            "name": names.config_map(plan.name), "items": [{"key": SIDECAR_CONFIG_FILE, "path": SIDECAR_CONFIG_FILE}]}})
        if plan.disaggregated:
            volumes.append({"name": "api-token", "projected": {"sources": [
                {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}},
            ]}})
        volumes += [_secret_volume(volume, secret, files) for volume, _, secret, files in _sidecar_secrets(plan)]
    return volumes


def _strategy(plan: Plan, pool: PoolPlan) -> dict[str, Any]:
    # GPU pools that can spare a pod roll without asking for an extra GPU; the rest surge by one.
    floor = pool.autoscaling.min_replicas if pool.autoscaling else pool.replicas
    if pool.planned and plan.spec.autoscaling is not None:
        bounds = plan.spec.autoscaling.prefill if pool.role == Role.PREFILL else plan.spec.autoscaling.decode
        floor = bounds.min_replicas
    if pool.gpu and floor >= 2:
        rolling = {"maxSurge": 0, "maxUnavailable": 1}
    else:
        rolling = {"maxSurge": 1, "maxUnavailable": 0}
    return {"type": "RollingUpdate", "rollingUpdate": rolling}


def deployment(plan: Plan, pool: PoolPlan, owner: dict[str, Any] | None = None) -> dict[str, Any]:
    containers = [_vllm_container(plan, pool)]
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "containers": containers,
        "volumes": _volumes(plan, pool),
    }
    if pool.role == Role.DECODE:
        containers.append(_sidecar_container(plan))
        pod["terminationGracePeriodSeconds"] = DECODE_GRACE_SECONDS
        if plan.disaggregated:
            pod["serviceAccountName"] = names.sidecar_account(plan.name)
    pod["securityContext"] = dict(_POD_SECURITY)
    if pool.node_selector:
        pod["nodeSelector"] = dict(pool.node_selector)
    if pool.tolerations:
        pod["tolerations"] = [dict(t) for t in pool.tolerations]
    if pool.affinity:
        pod["affinity"] = dict(pool.affinity)

    # An HPA or the planner (spec.autoscaling) owns the count of an autoscaled pool.
    spec: dict[str, Any] = {} if pool.external_replicas else {"replicas": pool.replicas}
    spec |= {
        "selector": {"matchLabels": names.selector(plan.name, pool.role)},
        "revisionHistoryLimit": 3,
        "strategy": _strategy(plan, pool),
        "template": {
            "metadata": {
                "labels": {**names.labels(plan.name, pool.role), **dict(pool.pod_labels), names.REVISION: pool.config_hash,
                           **({names.KV_REVISION: plan.kv_revision}
                              if plan.kv_revision and pool.role in (Role.PREFILL, Role.DECODE) else {})},
                "annotations": {names.CONFIG_HASH: pool.config_hash},
            },
            "spec": pod,
        },
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            **names.metadata(plan.name, plan.namespace, pool.name, pool.role, owner),
            "annotations": {names.CONFIG_HASH: pool.config_hash},
        },
        "spec": spec,
    }
