"""The disaggregated path driven by hand, leg by leg, against the harness servers.

render -> prefill (``legs.prefill_leg``) -> decode (``legs.decode_leg``) -> derender, batch or
streamed chunk by chunk with one ``stream_state`` per choice index. It uses the sidecar's own
leg rewrites and vLLM 0.32 derender fixes, so these tests pin the wire contract the sidecar
builds on.
"""

from __future__ import annotations

import uuid
from urllib.parse import urlsplit
from typing import Any

import requests

from disagg_sidecar.plan import legs
from disagg_sidecar import wire
from disagg_sidecar.derender.fixes import generate_for_derender, normalise_chat_response
from disagg_sidecar.connectors import PrefilledAt, get_connector
from tests.harness.openai_views import sse_events

TIMEOUT = 120


def post(url: str, body: dict[str, Any], **kw) -> requests.Response:
    resp = requests.post(url, json=body, timeout=TIMEOUT, **kw)
    assert resp.status_code == 200, f"{url}: {resp.status_code} {resp.text[:2000]}"
    return resp


def coupled_chat(sset, body: dict[str, Any]) -> dict[str, Any] | list:
    resp = post(sset.url("coupled") + "/v1/chat/completions", body, stream=bool(body.get("stream")))
    return list(sse_events(resp.iter_lines())) if body.get("stream") else resp.json()


class ManualPipeline:
    def __init__(self, sset, connector: str = "ExampleConnector"):
        self.sset = sset
        self.connector = get_connector(connector)

    def render_chat(self, chat: dict[str, Any]) -> dict[str, Any]:
        return post(self.sset.url("render") + wire.CHAT_RENDER, chat).json()

    def prefill(self, gen: dict[str, Any], request_id: str) -> dict[str, Any]:
        body = legs.prefill_leg(gen, self.connector, tokens_only=True)
        return post(self.sset.url("prefill") + wire.GENERATE, body, headers={wire.REQUEST_ID: request_id}).json()

    def decode(self, gen: dict[str, Any], prefill_resp: dict[str, Any], request_id: str):
        prefilled = PrefilledAt(urlsplit(self.sset.url("prefill")).hostname or "")
        kv = self.connector.decode_params(prefill_resp.get(wire.KV_TRANSFER_PARAMS), prefilled)
        body = legs.decode_leg(gen, kv, output_mode="tokens")
        resp = post(self.sset.url("decode") + wire.GENERATE, body, headers={wire.REQUEST_ID: request_id},
                    stream=bool(body.get("stream")))
        return list(sse_events(resp.iter_lines())) if body.get("stream") else resp.json()

    def chat(self, chat: dict[str, Any]) -> dict[str, Any] | list:
        """The whole path; returns an OpenAI chat response, or the list of streamed chunks + [DONE]."""
        request_id = uuid.uuid4().hex
        gen = self.render_chat(chat)
        prefill_resp = self.prefill(gen, request_id)
        out = self.decode(gen, prefill_resp, request_id)
        derender = self.sset.url("render") + wire.CHAT_DERENDER
        common = {"prompt_tokens": len(gen["token_ids"]), "prompt_token_ids": gen["token_ids"], "chat_request": chat}
        keep_stop = bool(chat.get("include_stop_str_in_output"))
        if not chat.get("stream"):
            resp = post(derender, {"generate_response": generate_for_derender(out, keep_stop), **common}).json()
            return normalise_chat_response(resp, out.get("usage"), chat.get("tool_choice"))
        chunks: list = []
        states: dict[int, Any] = {}
        for event in out:
            if event == "[DONE]":
                continue  # never sent to derender
            index = event["choices"][0]["index"] if event.get("choices") else None
            resp = post(derender, {"stream": True, "generate_chunk": generate_for_derender(event, keep_stop),
                                   "stream_state": states.get(index), **common}).json()
            if index is not None:
                states[index] = resp["stream_state"]
            chunks.append(resp["chunk"])
        return chunks + ["[DONE]"]
