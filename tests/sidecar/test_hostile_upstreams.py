"""Hostile upstreams against the real sidecar app (docs/security.md, "Upstream answers"): render,
prefill and decode engines that redirect, name other hosts, answer wrong shapes, truncate,
trickle or oversize. Each case asserts the client's answer (an API-shaped error, or the correct
answer), that nothing reached a host that is no endpoint (the bystander), and that the sidecar
is healthy after.
"""

from __future__ import annotations

import ast
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

