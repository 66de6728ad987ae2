"""API keys: the sidecar's legs authenticate to engines started with one (a real ``launch render``
server with VLLM_API_KEY), and its client port refuses requests without its own key."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.sidecar.support import SERVED, fake_config, fake_engine, run_sidecar, wait_for
from disagg_engine.servers import start_all, stop_all
from disagg_engine.testing.server_set import role_specs
from disagg_engine.testing.tiny_model import ensure_model
from disagg_sidecar import auth
from disagg_sidecar.config import SidecarConfig

ENGINE_KEY = "engine-key-for-tests"
CLIENT_KEY = "client-key-for-tests"
CHAT = {"model": SERVED, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4}


def _key_file(tmp_path: Path, name: str, key: str) -> str:
    path = tmp_path / name
    path.write_text(key + "\n")
    return str(path)


@pytest.fixture(scope="module")
def keyed_render() -> Iterator[str]:
    """One ``launch render`` server requiring ENGINE_KEY (the cheapest real vLLM server)."""
    logs = Path(tempfile.mkdtemp(prefix="disagg-auth-"))
    specs = role_specs(("render",), ensure_model(), logs, env={"VLLM_API_KEY": ENGINE_KEY})
    servers = start_all(specs, logs, timeout=300)
    try:
        yield servers[0].url
    finally:
        stop_all(servers)


@pytest.mark.engine
def test_vllm_guards_its_api_but_not_health(keyed_render: str) -> None:
    render = keyed_render + "/v1/chat/completions/render"
    body = {"model": SERVED, "messages": CHAT["messages"]}
    assert requests.post(render, json=body, timeout=30).status_code == 401
    assert requests.post(render, json=body, headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401
    assert requests.post(render, json=body, headers={"Authorization": f"Bearer {ENGINE_KEY}"},
                         timeout=30).status_code == 200
    assert requests.get(keyed_render + "/health", timeout=30).status_code == 200


@pytest.mark.engine
def test_every_leg_carries_the_engine_key(keyed_render: str, tmp_path: Path) -> None:
    """Render (real, keyed) accepts the sidecar's render leg; the fake prefill/decode engine sees
    the key on its legs and on the health probes. Without the key the render leg is refused."""
    with fake_engine() as engine:
        config = fake_config(engine, render={"url": keyed_render},
                             auth={"engine_api_key_file": _key_file(tmp_path, "engine", ENGINE_KEY)})
        with run_sidecar(config) as sidecar:
            r = requests.post(sidecar.url + "/v1/chat/completions", json=CHAT, timeout=60)
            assert r.status_code == 400 and "fake engine" in r.text, r.text  # got past render, to the fake
            assert engine.posts(), "no leg reached the engine after render"
            assert wait_for(lambda: any(c.path == "/health" for c in engine.calls), timeout=10)
            assert {c.headers.get("Authorization") for c in engine.calls} == {f"Bearer {ENGINE_KEY}"}

        del config["auth"]
        engine.calls.clear()
        with run_sidecar(config) as sidecar:
            r = requests.post(sidecar.url + "/v1/chat/completions", json=CHAT, timeout=60)
            assert r.status_code == 401, r.text
            assert not engine.posts(), "a leg went on after render refused it"


@pytest.fixture
def guarded(tmp_path: Path) -> Iterator[tuple[str, object]]:
    with fake_engine() as engine:
        config = fake_config(engine, auth={"client_api_key_file": _key_file(tmp_path, "client", CLIENT_KEY)})
        with run_sidecar(config) as sidecar:
            yield sidecar.url, engine


@pytest.mark.parametrize("header", [None, "Bearer wrong-key", f"Basic {CLIENT_KEY}", "Bearer "])
def test_a_missing_or_wrong_client_key_gets_openais_401(guarded, header: str | None) -> None:
    url, engine = guarded
    headers = {"Authorization": header} if header is not None else {}
    for path in ("/v1/chat/completions", "/v1/completions", "/inference/v1/generate"):
        r = requests.post(url + path, json=CHAT, headers=headers, timeout=30)
        assert r.status_code == 401, (path, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
        assert CLIENT_KEY not in r.text and "wrong-key" not in r.text
        assert r.headers["WWW-Authenticate"] == "Bearer"
    assert requests.get(url + "/v1/models", headers=headers, timeout=30).status_code == 401
    assert not engine.posts()


def test_the_right_client_key_passes_and_probes_stay_open(guarded) -> None:
    url, engine = guarded
    r = requests.post(url + "/v1/chat/completions", json=CHAT, headers={"Authorization": f"bearer {CLIENT_KEY}"},
                      timeout=30)
    assert r.status_code == 400 and "fake engine" in r.text  # the fake engine's own answer
    assert all("Authorization" not in c.headers for c in engine.calls)  # the client's key stays here
    for path in ("/health", "/health/live", "/metrics"):
        assert requests.get(url + path, timeout=30).status_code == 200, path


def test_auth_is_optional_and_key_files_are_checked(tmp_path: Path) -> None:
    base = {"decode": {"url": "http://127.0.0.1:1"}}
    assert SidecarConfig.model_validate(base).auth.client_api_key_file is None
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        auth.read_key(str(empty))
    config = SidecarConfig.model_validate({**base, "auth": {"engine_api_key_file": _key_file(tmp_path, "k", "abc")}})
    assert auth.upstream_headers(config) == {"Authorization": "Bearer abc"}
    assert auth.upstream_headers(SidecarConfig.model_validate(base)) == {}
