"""spec.security: the engine key Secret, who gets the key and how, the client key, TLS between
tiers, the sidecar's configuration, and convergence creating the Secret once (docs/security.md)."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import pytest

from tests.operator.builders import full_spec, plan_of
from tests.operator.cases import merged
from disagg_operator import engine_args
from disagg_operator.kinds import BY_TYPE
from disagg_operator.objects import build_objects
from disagg_operator.reconcile import converge
from disagg_operator.manifest import parse_spec
from disagg_sidecar.config import SidecarConfig, dump_config

OFF = {"security": {"engineAPIKey": {"enabled": False}}}
CLIENT = {"security": {"clientAPIKey": {"name": "client-keys", "key": "token"}}}
TLS = {"security": {"tls": {"secretName": "engine-certs"}}}
KEY_ENV = {"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {"name": "qwen3-8b-engine-api-key", "key": "api-key"}}}


def objects(spec: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in build_objects(plan_of(spec), {"uid": "u1"})}


def containers(objs: dict[tuple[str, str], dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(name, c["name"]): c for (kind, name), o in objs.items() if kind == "Deployment"
            for c in o["spec"]["template"]["spec"]["containers"]}


def test_on_by_default_every_engine_gets_the_key_from_the_secret_never_in_args() -> None:
    objs = objects(full_spec())
    secret = objs[("Secret", "qwen3-8b-engine-api-key")]
    assert "data" not in secret and "stringData" not in secret  # the key is drawn when it is created
    assert secret["metadata"]["ownerReferences"] == [{"uid": "u1"}]  # garbage-collected with the model
    engines = {k: c for k, c in containers(objs).items() if k[1] == "vllm"}
    assert {k[0] for k in engines} == {"qwen3-8b-prefill", "qwen3-8b-decode", "qwen3-8b-render", "qwen3-8b-derender"}
    for c in engines.values():
        assert KEY_ENV in c["env"]
        assert not any("api-key" in a or "api_key" in a for a in [*c["command"], *c["args"]])


def test_the_sidecar_reads_the_key_from_a_mounted_file() -> None:
    objs = objects(full_spec())
    decode = objs[("Deployment", "qwen3-8b-decode")]["spec"]["template"]["spec"]
    sidecar = containers(objs)[("qwen3-8b-decode", "sidecar")]
    assert "env" not in sidecar or all(e["name"] != "VLLM_API_KEY" for e in sidecar["env"])
    mount = next(m for m in sidecar["volumeMounts"] if m["name"] == "engine-api-key")
    volume = next(v for v in decode["volumes"] if v["name"] == "engine-api-key")
    assert volume["secret"]["secretName"] == "qwen3-8b-engine-api-key" and volume["secret"]["defaultMode"] == 0o440
    assert mount["readOnly"] and not any(m["name"] == "engine-api-key"
                                         for m in containers(objs)[("qwen3-8b-decode", "vllm")]["volumeMounts"])
    config = SidecarConfig.model_validate(dump_config(plan_of(full_spec()).sidecar.config))
    item = volume["secret"]["items"][0]
    assert config.auth.engine_api_key_file == f"{mount['mountPath']}/{item['path']}" and item["key"] == "api-key"
    assert config.auth.client_api_key_file is None


def test_switched_off_nothing_refers_to_a_key() -> None:
    objs = objects(merged(full_spec(), OFF))
    assert not [k for k in objs if k[0] == "Secret"]
    assert all(e.get("name") != "VLLM_API_KEY" for c in containers(objs).values() for e in c.get("env", []))
    assert "auth" not in dump_config(plan_of(merged(full_spec(), OFF)).sidecar.config)
    on, off = plan_of(full_spec()), plan_of(merged(full_spec(), OFF))
    assert all(a.config_hash != b.config_hash for a, b in zip(on.pools, off.pools))  # switching rolls the pods


def test_a_client_key_secret_is_mounted_for_the_sidecar_only() -> None:
    objs = objects(merged(full_spec(), CLIENT))
    decode = objs[("Deployment", "qwen3-8b-decode")]["spec"]["template"]["spec"]
    volume = next(v for v in decode["volumes"] if v["name"] == "client-api-key")
    assert volume["secret"]["secretName"] == "client-keys" and volume["secret"]["items"] == [
        {"key": "token", "path": "api-key"}]
    mount = next(m for m in containers(objs)[("qwen3-8b-decode", "sidecar")]["volumeMounts"]
                 if m["name"] == "client-api-key")
    config = plan_of(merged(full_spec(), CLIENT)).sidecar.config
    assert config.auth.client_api_key_file == f"{mount['mountPath']}/api-key"
    assert ("Secret", "client-keys") not in objs  # the user's Secret: never written by the operator


@pytest.mark.parametrize("arg", ["--api-key=x", "--api-key", "--api-k"])
def test_the_key_cannot_be_passed_as_a_flag(arg: str) -> None:
    assert engine_args.forbidden_flag(arg, engine_args.OWNED_FLAGS) == "--api-key"
    with pytest.raises(Exception, match="--api-key"):
        parse_spec(merged(full_spec(), {"model": {"engineArgs": [arg, "k"]}}))


class FakeApi:
    """The API server for create-once objects: a name that exists is kept as it is."""

    def __init__(self) -> None:
        self.stored: dict[str, dict[str, Any]] = {}
        self.applied: list[str] = []

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        assert not BY_TYPE[(obj["apiVersion"], obj["kind"])].create_only, "a create-only object was applied"
        self.applied.append(obj["kind"])
        return {**obj, "metadata": {**obj["metadata"], "resourceVersion": "1"}}

    def create_if_missing(self, obj: Mapping[str, Any]) -> bool:
        if obj["metadata"]["name"] in self.stored:
            return False
        self.stored[obj["metadata"]["name"]] = dict(obj)
        return True

    def delete(self, obj: Mapping[str, Any]) -> None:
        raise AssertionError("nothing to prune")

    def serves(self, kind: Any) -> bool:
        return True


def test_converge_creates_the_secret_once_with_a_random_key() -> None:
    doc = {"apiVersion": "disagg.dev/v1alpha1", "kind": "DisaggregatedModel",
           "metadata": {"name": "qwen3-8b", "namespace": "prod", "uid": "uid-keys", "generation": 1},
           "spec": full_spec()}
    api = FakeApi()
    first = converge(doc, {}, api, now="t")
    assert "Secret/qwen3-8b-engine-api-key" in first.applied
    key = base64.b64decode(api.stored["qwen3-8b-engine-api-key"]["data"]["api-key"])
    assert len(key) >= 43  # 32 random bytes, url-safe base64
    again = converge(doc, {}, api, now="t")
    assert "Secret/qwen3-8b-engine-api-key" not in again.applied
    assert base64.b64decode(api.stored["qwen3-8b-engine-api-key"]["data"]["api-key"]) == key
    other = FakeApi()
    converge({**doc, "metadata": {**doc["metadata"], "uid": "uid-other"}}, {}, other, now="t")
    assert other.stored["qwen3-8b-engine-api-key"]["data"] != api.stored["qwen3-8b-engine-api-key"]["data"]



def test_tls_serves_every_engine_on_https_and_the_sidecar_verifies_one_name() -> None:
    objs = objects(merged(full_spec(), TLS))
    for (pod, name), c in containers(objs).items():
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        if name == "vllm":
            args = c["args"]
            assert args[args.index("--ssl-keyfile") + 1] == f"{mounts['engine-tls']}/tls.key"
            assert args[args.index("--ssl-certfile") + 1] == f"{mounts['engine-tls']}/tls.crt"
            assert all(c[p]["httpGet"]["scheme"] == "HTTPS" for p in ("startupProbe", "readinessProbe", "livenessProbe"))
        else:  # the sidecar: the CA, never the engines' key; its client port stays HTTP
            assert "engine-tls" not in mounts and "engine-tls-ca" in mounts
            assert "scheme" not in c["readinessProbe"]["httpGet"]
    decode = objs[("Deployment", "qwen3-8b-decode")]["spec"]["template"]["spec"]
    volumes = {v["name"]: v["secret"] for v in decode["volumes"] if "secret" in v}
    assert volumes["engine-tls"]["secretName"] == volumes["engine-tls-ca"]["secretName"] == "engine-certs"
    assert [i["key"] for i in volumes["engine-tls"]["items"]] == ["tls.crt", "tls.key"]
    assert [i["key"] for i in volumes["engine-tls-ca"]["items"]] == ["ca.crt"]
    assert ("Secret", "engine-certs") not in objs

    config = SidecarConfig.model_validate(dump_config(plan_of(merged(full_spec(), TLS)).sidecar.config))
    assert config.tls is not None and config.tls.server_name == "qwen3-8b-engine.prod.svc"
    assert config.tls.ca_file.startswith(next(m["mountPath"] for m in containers(objs)[("qwen3-8b-decode", "sidecar")]
                                              ["volumeMounts"] if m["name"] == "engine-tls-ca"))
    urls = [config.decode.url, *config.render_urls, *config.derender_urls]
    assert all(u.startswith("https://") for u in urls)
    assert config.prefill.discovery is not None and config.prefill.discovery.scheme == "https"


def test_without_tls_the_sidecar_config_is_unchanged() -> None:
    dumped = dump_config(plan_of(full_spec()).sidecar.config)
    assert "tls" not in dumped and "scheme" not in dumped["prefill"]["discovery"]
    assert dumped["decode"]["url"].startswith("http://")


@pytest.mark.parametrize("arg", ["--ssl-keyfile=/k", "--ssl-certfile", "--ssl-certf"])
def test_tls_flags_belong_to_the_spec(arg: str) -> None:
    with pytest.raises(Exception, match="--ssl-"):
        parse_spec(merged(full_spec(), {"pools": {"render": {"extraArgs": [arg, "x"]}}}))
