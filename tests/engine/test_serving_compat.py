"""The engine extension's version seams (vllm_compat, serving.py) against the installed vLLM and the
release table, without a server: what it leaves to vLLM, and the stream generator's keywords."""

from __future__ import annotations

import asyncio

import pytest

from disagg_sidecar import vllm_releases


@pytest.fixture(scope="module")
def compat():
    # vLLM is imported here, not at collection (see test_shapes.py).
    from disagg_engine import vllm_compat
    return vllm_compat


def _request(compat, **fields):
    from disagg_engine.protocol import DisaggGenerateRequest
    return DisaggGenerateRequest.model_validate({"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2},
                                                 **fields})


def test_what_the_running_vllm_offers_is_its_row_of_the_table(compat) -> None:
    row = vllm_releases.known(compat.vllm_version())
    assert row is not None, f"the suite runs a vLLM outside the table: {compat.vllm_version()}"
    assert compat.RELEASE == row
    # Detected from vLLM's code, so a newer untested release is read right; equal to the table here.
    assert compat.STOCK_STREAMING_DERENDER is row.stock_streaming_derender
    assert compat.NATIVE_DERENDER is row.stock_batch_derender
    assert compat.DERENDER_SESSIONS is row.derender_sessions


@pytest.mark.parametrize(("chat_request", "stream"), [(False, False), (False, True), (True, False), (True, True)])
def test_vllms_own_derender_is_left_to_vllm(compat, chat_request: bool, stream: bool) -> None:
    from disagg_engine.serving import DisaggServingTokens

    row = vllm_releases.release(compat.vllm_version())
    chat = {"chat_request": {"messages": [{"role": "user", "content": "hi"}]}} if chat_request else {}
    request = _request(compat, output_mode="derender", stream=stream, **chat)
    stock = not chat_request and (row.stock_streaming_derender if stream else row.stock_batch_derender)
    assert DisaggServingTokens._stock_derender(request) is stock


def test_the_stream_generator_forwards_keywords_it_does_not_own(compat) -> None:
    """vLLM 0.34 passes ``processors=`` (and a later release may pass more): the override hands every
    keyword to vLLM's generator. ``Recorder`` stands where vLLM's own generator is in the MRO."""
    from disagg_engine.serving import DisaggServingTokens

    seen: dict = {}

    class Recorder(compat.ServingTokens):
        async def serve_tokens_stream_generator(self, request, result_generator, request_id, model_name,
                                                request_metadata, **kwargs):
            seen.update(kwargs, request_id=request_id)
            yield "data: [DONE]\n\n"

    class Probe(DisaggServingTokens, Recorder):
        pass

    serving = Probe.__new__(Probe)
    request = _request(compat, output_mode="text", stream=True)

    async def run() -> list[str]:
        gen = serving.serve_tokens_stream_generator(request, None, "rid", "m", None, processors=None, later_knob=1)
        return [event async for event in gen]

    assert asyncio.run(run()) == ["data: [DONE]\n\n"]
    assert seen == {"processors": None, "later_knob": 1, "request_id": "rid"}
