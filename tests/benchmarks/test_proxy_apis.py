"""The proxy part's API parameter (benchmarks/proxy.py): each API's requests are valid for vLLM's
own request model of that API, force the same answer, and get their own rows and keys beside
chat's, which keep the names the goals read."""

from __future__ import annotations

import pytest

from benchmarks import proxy
from benchmarks.report import _proxy
from benchmarks.stats import summary


def test_every_api_has_a_batch_and_a_stream_kind_and_generate_stays() -> None:
    assert set(proxy.APIS) == {"chat", "messages", "responses"}
    assert proxy.KINDS == ("chat", "chat_stream", "messages", "messages_stream", "responses", "responses_stream",
                           "generate", "generate_stream")


@pytest.mark.parametrize("api, model", [
    ("chat", ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest")),
    ("messages", ("vllm.entrypoints.anthropic.protocol", "AnthropicMessagesRequest")),
    ("responses", ("vllm.entrypoints.openai.responses.protocol", "ResponsesRequest")),
])
@pytest.mark.parametrize("stream", [False, True])
def test_an_apis_requests_are_its_vllm_models_and_force_the_same_answer(api: str, model: tuple[str, str],
                                                                        stream: bool) -> None:
    import importlib

    cls = getattr(importlib.import_module(model[0]), model[1])
    ids = [11, 12, 13, 2]
    requests_ = [proxy.APIS[api].request(ids, stream, i) for i in range(3)]
    for body in requests_:
        parsed = cls.model_validate(body)
        assert parsed.vllm_xargs == {"forced_token_ids": ids} and bool(parsed.stream) is stream
        assert (parsed.max_output_tokens if api == "responses" else parsed.max_tokens) >= len(ids)
        assert parsed.chat_template_kwargs == {"enable_thinking": False}  # a plain answer, not reasoning
    prompts = {str(b.get("messages", b.get("input"))) for b in requests_}
    assert len(prompts) == 3  # no two prompts alike (no prefix-cache hits)


def _run(direct_s: float, sidecar_s: float, render_ms: float) -> tuple[dict, dict]:
    def side(latency: float, legs: dict) -> dict:
        return {"latency": [latency] * 4, "ttft": [latency] * 4, "gaps": [], "chunks": 0, "wall": 4 * latency,
                "requests": 4, "cpu": 0.004, "legs_ms": legs}
    return side(direct_s, {}), side(sidecar_s, {"render": render_ms, "decode": 1e3 * direct_s})


def test_each_api_gets_its_rows_and_keys_beside_chats() -> None:
    added_ms = {"chat": 3.0, "messages": 5.0, "responses": 4.0, "generate": 1.0}  # the sidecar's added latency per API
    raw = {}
    for kind in proxy.KINDS:
        api = kind.removesuffix("_stream")
        raw[kind] = {}
        for c in (1, 16):
            d, s = _run(0.010, 0.010 + added_ms[api] / 1e3, render_ms=2.0)
            raw[kind][c] = {"direct": [d], "sidecar": [s]}
    run = [{"batch_cpu_s": 0.002}]
    cost = {"tokens": 64, "us_per_chunk": summary([40.0]), "us_per_chunk_upper": summary([45.0]),
            "chat_shaped": {"runs": run, "us_per_chunk": summary([50.0])},
            "generate": {"runs": run, "us_per_chunk": summary([30.0])},
            "floor": {"runs": run, "us_per_chunk": summary([20.0])},
            "concurrent": {"streams": 16, "chat": {"runs": run, "us_per_chunk": summary([25.0])},
                           "floor": {"runs": run, "us_per_chunk": summary([15.0])}}}
    result = proxy.summarise(raw, cost)
    keys = result["keys"]
    assert keys["proxy_added_p50_ms_c1"] == pytest.approx(3.0)
    assert keys["proxy_added_beyond_legs_p50_ms_c1"] == pytest.approx(1.0)  # 3 ms minus the 2 ms render leg
    assert keys["proxy_messages_added_p50_ms_c1"] == pytest.approx(5.0)
    assert keys["proxy_messages_added_beyond_legs_p50_ms_c1"] == pytest.approx(3.0)
    assert keys["proxy_responses_added_p50_ms_c1"] == pytest.approx(4.0)
    assert keys["messages_sidecar_cpu_ms_per_request"] == keys["sidecar_cpu_ms_per_request"] == pytest.approx(1.0)
    # throughput: 4 requests in 4 latencies on each side
    assert keys["proxy_messages_throughput_ratio_c16"] == pytest.approx(10.0 / 15.0)
    assert keys["proxy_messages_stream_throughput_ratio_c16"] == pytest.approx(10.0 / 15.0)
    assert keys["proxy_throughput_ratio_c16"] == pytest.approx(10.0 / 13.0)
    assert not any("generate_added" in k for k in keys)
    assert keys["sidecar_cpu_us_per_chunk"] == pytest.approx(40.0)
    assert keys["sidecar_shaped_cpu_us_per_chunk"] == pytest.approx(50.0)
    assert keys["sidecar_cpu_us_per_chunk_c16"] == pytest.approx(25.0)
    assert keys["relay_floor_cpu_us_per_chunk_c16"] == pytest.approx(15.0)
    table = "\n".join(_proxy(result))
    assert "With 16 such streams at once" in table and "25.0" in table
    for kind in proxy.KINDS:
        assert f"| {kind} | 1 |" in table and f"| {kind} | 16 |" in table
