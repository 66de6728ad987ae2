"""One forced chat request sent to the coupled reference server and, through the openai SDK, to a
deployment under test: both answers as comparable views (tests/harness/openai_views.py)."""
from __future__ import annotations

from typing import Any

import requests
from openai import OpenAI

from tests.harness.forced import Forcer
from tests.harness.openai_views import chat_stream_view, chat_view, sse_events


def forced_views(engine_set: Any, forcer: Forcer, client: OpenAI, name: str, stream: bool) -> tuple[dict, dict]:
    """(the deployment's view, the coupled reference's view) of the forced output ``name``."""
    body = forcer.chat_body(name, stream=stream)
    coupled = requests.post(engine_set.url("coupled") + "/v1/chat/completions", json=body, timeout=300, stream=stream)
    extra = {"vllm_xargs": body.pop("vllm_xargs")}
    kwargs = {k: v for k, v in body.items() if k not in ("model", "messages")}
    got = client.chat.completions.create(model=body["model"], messages=body["messages"], extra_body=extra, **kwargs)
    if stream:
        return (chat_stream_view([c.model_dump() for c in got] + ["[DONE]"]),
                chat_stream_view(sse_events(coupled.iter_lines())))
    return chat_view(got.model_dump()), chat_view(coupled.json())
