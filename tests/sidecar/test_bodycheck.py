"""Request bodies checked before parsing, work limits and the memory budget (pure, no servers)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from disagg_sidecar.edge import bodycheck
from disagg_sidecar.plan import requestlimits
from disagg_sidecar.budget import MemoryBudget, Reservation
from disagg_sidecar.config import Limits
from disagg_sidecar.errors import SidecarError
from disagg_sidecar.pipeline.failures import leg_failure, streamed_error
from disagg_sidecar.upstream.reading import LegError


def _refused(raw: bytes, depth: int = 64) -> SidecarError:
    with pytest.raises(SidecarError) as info:
        bodycheck.check(raw, depth)
        bodycheck.loads(raw, depth)
    return info.value


def _accepted(raw: bytes, depth: int = 64):
    bodycheck.check(raw, depth)
    return bodycheck.loads(raw, depth)


def test_depth() -> None:
    assert _accepted(b"[" * 64 + b"]" * 64) is not None
    for raw in (b"[" * 65 + b"]" * 65, b"[" * 10_000 + b"]" * 10_000, b'{"a":' * 100 + b"1" + b"}" * 100,
                b"[" * 10_000, b"[0,[0,[0," * 40 + b"0" + b"]]]" * 40, b"[[]," * 100 + b"[]" + b"]" * 100):
        error = _refused(raw)
        assert error.status == 400 and "limits.max_json_depth" in error.message, raw[:20]
    # Brackets inside strings are text, however many.
    assert _accepted(json.dumps({"prompt": "[" * 1000 + "{" * 1000}).encode())["prompt"].startswith("[[")
    assert _accepted(json.dumps({"p": ['"[\\' * 100]}).encode())
    assert bodycheck.depth_exceeds(b"(" * 5 + b")" * 5, 4) and not bodycheck.depth_exceeds(b"(" * 4 + b")" * 4, 4)
    assert not bodycheck.depth_exceeds(b"(()())(()", 4), "unbalanced is the parser's to refuse"


def test_encodings() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "héllo 中文 😀"}]}
    assert _accepted(json.dumps(body, ensure_ascii=False).encode()) == body
    assert _accepted(json.dumps(body).encode()) == body  # \\u escapes, a valid pair included
    for raw in (json.dumps(body).encode("utf-16"), json.dumps(body).encode("utf-16-le"),
                json.dumps(body).encode("utf-32"), b"\xef\xbb\xbf" + json.dumps(body).encode(),
                b'{"stop":"\xff"}', b'{"stop":"\xc3"}', b'{"cache_salt":"\xed\xa0\x80"}',  # an encoded surrogate
                b'{"stop":"\xf8\x88\x80\x80\x80"}', b'{"a":"\x80abc"}'):
        error = _refused(raw)
        assert error.status == 400 and ("UTF-8" in error.message), (raw, error.message)


def test_lone_surrogate_escapes() -> None:
    for raw in (b'{"stop":"\\ud800"}', b'{"cache_salt":"x\\udfff"}', b'{"s":"\\uD83D"}', b'{"s":"\\ude00\\ud83d"}',
                b'{"s":"\\\\\\ud800"}', b'["\\ud83d\\u0041"]', b'{"\\ud800":1}'):
        error = _refused(raw)
        assert error.status == 400 and "surrogate" in error.message, raw
    # An escaped backslash followed by "ud800" is text; a pair is one character.
    assert _accepted(b'{"s":"\\\\ud800"}') == {"s": "\\ud800"}
    assert _accepted(b'{"s":"\\ud83d\\ude00\\\\"}') == {"s": "😀\\"}


def test_invalid_json_and_constants() -> None:
    for raw in (b"{not json", b"", b'{"a":NaN}', b'{"a":Infinity}', b'{"a":-Infinity}', b'{"n":' + b"9" * 5000 + b"}",
                b'{"a":1}x', b'{"a":"\x01"}'):
        error = _refused(raw)
        assert error.status == 400 and "not valid JSON" in error.message, raw[:30]


SHAPES = {
    "empty objects": lambda n: b'{"messages":[' + b",".join([b"{}"] * (n // 3)) + b"]}",
    "empty arrays": lambda n: b"[" + b",".join([b"[]"] * (n // 3)) + b"]",
    "one-key objects": lambda n: b"[" + b",".join([b'{"a":1}'] * (n // 8)) + b"]",
    "messages": lambda n: json.dumps({"messages": [{"role": "user", "content": "hi"}] * (n // 34)}).encode(),
    "short strings": lambda n: b"[" + b",".join([b'"ab"'] * (n // 5)) + b"]",
    "token ids": lambda n: b'{"prompt":[' + b",".join([b"151643"] * (n // 7)) + b"]}",
    "floats": lambda n: b"[" + b",".join([b"1e5"] * (n // 4)) + b"]",
    "ascii text": lambda n: b'{"prompt":"' + b"a" * n + b'"}',
    "emoji text": lambda n: b'{"prompt":"' + "😀".encode() + b"a" * n + b'"}',
    "escaped emoji text": lambda n: b'{"prompt":"\\ud83d\\ude00' + b"a" * n + b'"}',
    "cjk text": lambda n: b'{"prompt":"' + "中".encode() + b"a" * n + b'"}',
}


@pytest.mark.parametrize("name", SHAPES)
def test_parse_cost_is_an_upper_bound(name: str) -> None:
    """What ``check`` charges for a body is at least what ``json.loads`` allocates for it (measured
    with tracemalloc), so refusing what does not fit ``memory_bound`` bounds the real peak."""
    raw = SHAPES[name](1 << 20)
    charged = len(raw) + bodycheck.shape(raw, 64).parse_cost()
    peak = json_loads_peak(raw)
    assert peak + len(raw) <= charged, (name, peak, charged)
    print(f"{name}: parse peak {peak / len(raw):.1f} x body, charged {charged / len(raw):.1f} x")


def json_loads_peak(raw: bytes) -> int:
    """``json.loads``'s peak allocation for ``raw``, measured in an interpreter of its own:
    tracemalloc counts every thread's allocations, and the suite starts servers from threads."""
    code = ("import json, sys, tracemalloc; raw = sys.stdin.buffer.read(); tracemalloc.start(); "
            "value = json.loads(raw); print(tracemalloc.get_traced_memory()[1])")
    out = subprocess.run([sys.executable, "-c", code], input=raw, capture_output=True, check=True, timeout=60)
    return int(out.stdout)


def test_memory_bound_refuses_costly_shapes() -> None:
    big = 16 << 20
    error = _refused(SHAPES["empty objects"](big))
    assert error.status == 413 and "send fewer JSON values" in error.message
    assert _accepted(SHAPES["ascii text"](big - 20))["prompt"].startswith("aaa")  # 2 x its size
    assert _refused(SHAPES["emoji text"](big - 20)).status == 413  # a 4-byte-wide str twice: 9 x
    assert _accepted(SHAPES["emoji text"](4 << 20))


def test_request_limits() -> None:
    limits = Limits(max_n=8, max_prompts=4, max_legs=20)

    def refused(api: str, body: dict) -> str:
        with pytest.raises(SidecarError) as info:
            requestlimits.check(api, body, limits)
        assert info.value.status == 400
        return info.value.message

    requestlimits.check("chat", {"n": 8}, limits)
    requestlimits.check("completions", {"prompt": ["a", "b", "c", "d"], "n": 3}, limits)  # 1 + 4 x 4 legs
    requestlimits.check("completions", {"prompt": list(range(1000))}, limits)  # one tokenized prompt
    requestlimits.check("generate", {"token_ids": [1], "sampling_params": {"n": 8}}, limits)
    assert "limits.max_n" in refused("chat", {"n": 1_000_000_000})
    assert "limits.max_n" in refused("generate", {"token_ids": [1], "sampling_params": {"n": 9}})
    assert "limits.max_prompts" in refused("completions", {"prompt": ["a"] * 500})
    assert "limits.max_prompts" in refused("completions", {"prompt": [[1, 2]] * 5})
    assert "limits.max_legs" in refused("completions", {"prompt": ["a"] * 4, "n": 4})  # 1 + 4 x 5 = 21
    assert "positive integer" in refused("generate", {"sampling_params": {"n": "2"}})
    assert requestlimits.legs(prompts=3, n=2, rendered=True) == 10


def test_logprob_limit_is_vllms_rule_and_message() -> None:
    def refused(sampling: dict, limit: int) -> SidecarError:
        with pytest.raises(SidecarError) as info:
            requestlimits.check_logprobs(sampling, limit)
        return info.value

    for ok, limit in (({"logprobs": 20, "prompt_logprobs": 20}, 20), ({"logprobs": 0}, 0), ({"logprobs": 500}, None),
                      ({"logprobs": -1}, -1), ({"logprobs": None, "max_tokens": 5}, 20)):
        requestlimits.check_logprobs(ok, limit)
    requestlimits.check_logprobs(None, 20)
    error = refused({"logprobs": 21, "prompt_logprobs": 30}, 20)  # vLLM checks the sample logprobs first
    assert (error.status, json.loads(error.body)["error"]) == (400, {
        "message": "Requested sample logprobs of 21, which is greater than max allowed: 20 (parameter=logprobs, value=21)",
        "type": "BadRequestError", "param": "logprobs", "code": 400})
    assert json.loads(refused({"prompt_logprobs": 21}, 20).body)["error"]["param"] == "prompt_logprobs"
    assert "the whole vocabulary (-1)" in refused({"logprobs": -1}, 20).message


def test_memory_budget_reservations() -> None:
    budget = MemoryBudget(100)
    a, b = Reservation(budget), Reservation(budget)
    assert a.grow_to(60) and a.grow_to(40) and a.held == 60, "never shrinks while held"
    assert not b.grow_to(41) and b.held == 0 and budget.used == 60
    assert b.grow_to(40) and budget.used == 100
    a.release()
    b.release()
    assert budget.used == 0


def test_upstream_5xx_bodies_stay_out_of_client_errors() -> None:
    body = b'Traceback (most recent call last):\n  File "/srv/vllm/x.py"\nConnectionError: 10.0.0.5:8200'
    for error in (leg_failure(LegError("decode", "status", "http://10.0.0.5:8200", 500, body)),
                  SidecarError.upstream(500, body, "render"), SidecarError.upstream(503, b"{}", "decode")):
        assert error.status == 502 and b"10.0.0.5" not in error.body and b"Traceback" not in error.body
        assert json.loads(error.body)["error"]["type"] == "BadGatewayError"
    for kind in ("connect", "timeout", "disconnect"):
        error = leg_failure(LegError("prefill", kind, "http://10.0.0.5:8200"))
        assert b"10.0.0.5" not in error.body and error.status == 503
    streamed = streamed_error({"code": 500, "message": "EngineCore died at 10.0.0.5:8200"})
    assert streamed.status == 502 and b"10.0.0.5" not in streamed.body
    assert streamed_error({"code": 400, "message": "too long"}).message == "too long"
    assert streamed_error({"code": "x", "message": "?"}).status == 502
    four = SidecarError.upstream(400, b'{"error": {"message": "bad", "type": "BadRequestError"}}', "render")
    assert four.status == 400 and four.message == "bad", "engines' own 4xx answers pass"
