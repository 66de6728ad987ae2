"""Hostile upstreams against the real sidecar app (docs/security.md, "Upstream answers"): render,
prefill and decode engines that redirect, name other hosts, answer wrong shapes, truncate,
trickle or oversize. Each case asserts the client's answer (an API-shaped error, or the correct
answer), that nothing reached a host that is no endpoint (the bystander), and that the sidecar
is healthy after.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.sidecar import upstreams as fake
from tests.sidecar.support import SERVED, run_sidecar
from tests.sidecar.upstreams import Upstreams

CHAT = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": SERVED, "prompt": "hi", "max_tokens": 4}
SIDECAR_PACKAGE = Path(__file__).resolve().parents[2] / "sidecar" / "disagg_sidecar"


@pytest.fixture(scope="module")
def module_ups() -> Iterator[Upstreams]:
    with fake.upstreams() as ups:
        yield ups


@pytest.fixture
def ups(module_ups: Upstreams) -> Upstreams:
    module_ups.reset()
    return module_ups


def post(url: str, path: str, body: dict, timeout: float = 30) -> requests.Response:
    return requests.post(url + path, json=body, timeout=timeout)


def openai_error(resp: requests.Response) -> dict:
    assert resp.headers["Content-Type"].startswith("application/json"), resp.text[:300]
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


def assert_clean(resp: requests.Response | bytes, ups: Upstreams) -> None:
    """Nothing of an upstream's address or body in the client's answer; the bystander never asked."""
    content = resp if isinstance(resp, bytes) else resp.content
    for up in ups.all():
        assert up.host_port.encode() not in content, content[:300]
    assert b"Traceback" not in content and b"10.66.66.66" not in content
    assert not ups.bystander.calls, [c.path for c in ups.bystander.calls]


def assert_healthy(sidecar, ups: Upstreams) -> None:
    """The sidecar still answers a plain request correctly."""
    saved = {u.url: dict(u.routes) for u in ups.all()}
    for u in ups.all():
        u.routes.clear()
    try:
        assert requests.get(sidecar.url + "/health", timeout=10).status_code == 200
        resp = post(sidecar.url, "/v1/chat/completions", CHAT)
        assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == fake.ANSWER, resp.text
    finally:
        for u in ups.all():
            u.routes.update(saved[u.url])


# -- 1. redirects ------------------------------------------------------------------------------------

@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
@pytest.mark.parametrize("leg", ["render", "prefill", "decode", "decode-stream", "models", "generate"])
def test_no_redirect_is_followed(ups: Upstreams, leg: str, status: int) -> None:
    """A 3xx from any engine is a 502 in OpenAI's shape that says so; the host it names gets nothing."""
    tier = {"render": ups.render, "prefill": ups.prefill}.get(leg, ups.decode)
    path = {"render": "/v1/chat/completions/render", "models": "/v1/models"}.get(leg, "/inference/v1/generate")
    with run_sidecar(fake.config(ups)) as sidecar:
        tier.routes[path] = fake.redirect(ups.bystander.url, status)
        if leg == "models":
            resp = requests.get(sidecar.url + "/v1/models", timeout=30)
        elif leg == "generate":
            resp = post(sidecar.url, "/inference/v1/generate", {"token_ids": fake.PROMPT_IDS,
                                                                 "sampling_params": {"max_tokens": 2}})
        else:
            resp = post(sidecar.url, "/v1/chat/completions", {**CHAT, "stream": leg == "decode-stream"})
        assert resp.status_code == 502, resp.text
        error = openai_error(resp)
        assert error["type"] == "BadGatewayError"
        assert "redirect" in error["message"] or "status 3" in error["message"], error
        assert_clean(resp, ups)
        tier.routes.clear()
        assert_healthy(sidecar, ups)


def test_a_redirecting_prefill_engine_falls_back_to_decode(ups: Upstreams) -> None:
    """failure_policy fallback: decode prefills the prompt itself; the answer is the right one."""
    ups.prefill.routes["/inference/v1/generate"] = fake.redirect(ups.bystander.url)
    with run_sidecar(fake.config(ups, prefill={"failure_policy": "fallback"})) as sidecar:
        resp = post(sidecar.url, "/v1/chat/completions", CHAT)
        assert resp.status_code == 200 and resp.headers["x-disagg-prefill"] == "fallback", resp.text
        assert resp.json()["choices"][0]["message"]["content"] == fake.ANSWER
        (leg,) = ups.decode.posts("/inference/v1/generate")
        assert leg.body["kv_transfer_params"] is None
        assert_clean(resp, ups)


def test_every_upstream_call_refuses_redirects() -> None:
    """Each ``session.get``/``post`` in the sidecar passes ``allow_redirects=False`` (directly or
    as ``**NO_REDIRECTS``): the per-leg tests above cover today's calls, this one the next."""
    missing = []
    for path in SIDECAR_PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("get", "post", "request", "put", "delete")):
                continue
            owner = node.func.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name != "session":
                continue
            kws = {k.arg: k.value for k in node.keywords}
            ok = (isinstance(kws.get("allow_redirects"), ast.Constant) and kws["allow_redirects"].value is False) \
                or any(k.arg is None and getattr(k.value, "id", "") == "NO_REDIRECTS" for k in node.keywords)
            if not ok:
                missing.append(f"{path.relative_to(SIDECAR_PACKAGE)}:{node.lineno}")
    assert not missing, missing



# -- 2. kv_transfer_params ---------------------------------------------------------------------------

def nixl_params(**over) -> dict:
    """What vLLM's NixlConnector returns from a prefill engine at 127.0.0.1 (side channel 5600)."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [3, 4],
            "remote_engine_id": "engine-a", "remote_request_id": "r1", "remote_host": "127.0.0.1",
            "remote_port": 5600, "tp_size": 1, **over}


HOSTILE_KV = {
    "another host": nixl_params(remote_host="10.66.66.66", remote_port=22),
    "another port": nixl_params(remote_port=22),
    "a name for the host": nixl_params(remote_host="localhost"),
    "a port as text": nixl_params(remote_port="5600"),
    "not an object": [nixl_params()],
    "no engine id": {k: v for k, v in nixl_params().items() if k != "remote_engine_id"},
    "block ids as text": nixl_params(remote_block_ids="1,2"),
    "a nested object": nixl_params(extra={"remote_host": "10.66.66.66"}),
    "decode asked to send": nixl_params(do_remote_decode=True),
}


def nixl_config(ups: Upstreams, **prefill) -> dict:
    return fake.config(ups, kv_connector="NixlConnector", prefill=prefill)


def prefill_answering(params) -> fake.Handler:
    return fake.answer_json({"request_id": "p", "kv_transfer_params": params,
                             "choices": [{"index": 0, "token_ids": [21], "finish_reason": "length"}]})


@pytest.mark.parametrize("case", list(HOSTILE_KV))
def test_kv_params_naming_anything_but_the_prefilled_endpoint_never_reach_decode(ups: Upstreams, case: str) -> None:
    ups.prefill.routes["/inference/v1/generate"] = prefill_answering(HOSTILE_KV[case])
    with run_sidecar(nixl_config(ups)) as sidecar:  # failure_policy fail: a 502 that says why
        resp = post(sidecar.url, "/v1/chat/completions", CHAT)
        assert resp.status_code == 502 and resp.headers["x-disagg-prefill"] == "failed", resp.text
        assert openai_error(resp)["message"] == "The prefill tier answered with an invalid answer"
        assert not ups.decode.posts("/inference/v1/generate"), "nothing reached decode"
        assert_clean(resp, ups)
    ups.decode.calls.clear()
    with run_sidecar(nixl_config(ups, failure_policy="fallback")) as sidecar:  # decode prefills itself
        resp = post(sidecar.url, "/v1/chat/completions", CHAT)
        assert resp.status_code == 200 and resp.headers["x-disagg-prefill"] == "fallback", resp.text
        assert resp.json()["choices"][0]["message"]["content"] == fake.ANSWER
        (leg,) = ups.decode.posts("/inference/v1/generate")
        assert leg.body["kv_transfer_params"] is None
        assert_clean(resp, ups)


def test_kv_params_of_the_prefilled_endpoint_reach_decode_as_they_are(ups: Upstreams) -> None:
    for ports, port in (((5600,), 5600), ((5700, 5701), 5701)):
        ups.reset()
        params = nixl_params(remote_port=port, remote_block_ids=[[1, 2], [3]], remote_prefill_cached_tokens=4)
        ups.prefill.routes["/inference/v1/generate"] = prefill_answering(params)
        with run_sidecar(nixl_config(ups, side_channel_ports=list(ports))) as sidecar:
            resp = post(sidecar.url, "/v1/chat/completions", CHAT)
            assert resp.status_code == 200 and resp.headers["x-disagg-prefill"] == "remote", resp.text
        (leg,) = ups.decode.posts("/inference/v1/generate")
        assert leg.body["kv_transfer_params"] == params


def test_a_clients_kv_params_in_its_chat_request_never_reach_decode(ups: Upstreams) -> None:
    """The decode leg's parser context is the client's request: its kv_transfer_params (top level
    or in vllm_xargs) are taken out, the rest stays as the client sent it."""
    inline = {"output_modes": ["derender"], "streaming_output_modes": ["derender"],
              "derender_context_forms": ["chat_request"]}
    hostile = {"remote_host": "10.66.66.66", "remote_port": 22, "do_remote_prefill": True}
    body = {**CHAT, "kv_transfer_params": hostile, "vllm_xargs": {"kv_transfer_params": hostile, "keep": 1}}
    with run_sidecar(fake.config(ups, decode={"capabilities": inline})) as sidecar:
        for stream in (False, True):
            ups.decode.calls.clear()
            resp = post(sidecar.url, "/v1/chat/completions", {**body, "stream": stream})
            assert resp.status_code == 200, resp.text
            (leg,) = ups.decode.posts("/inference/v1/generate")
            assert leg.body["output_mode"] == "derender" and leg.body["kv_transfer_params"] is None
            assert leg.body["chat_request"] == {**CHAT, "stream": stream, "vllm_xargs": {"keep": 1}}
            assert b"10.66.66.66" not in json.dumps(leg.body).encode()
