"""``make demo``: serve the tiny test model disaggregated on this machine and stream one answer.

Starts a render server, a tokens-only prefill engine and a decode engine with Disagg's engine
extension (all vLLM CPU), then sends one chat request leg by leg — render, prefill (KV written
through ExampleConnector), decode with ``output_mode="derender"`` streaming — prints the streamed
answer and the time of each leg, and stops everything. The model has random weights: the answer
is gibberish; the pipeline is real.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

import requests

from disagg_engine.testing.server_set import start_server_set
from disagg_sidecar import legs, wire
from disagg_sidecar.connectors import get_connector

QUESTION = "Explain disaggregated serving in one sentence."


def main() -> int:
    logs = Path(tempfile.mkdtemp(prefix="disagg-demo-"))
    print(f"starting render, prefill and decode (vLLM CPU; logs in {logs}) ...", flush=True)
    t0 = time.monotonic()
    sset = start_server_set(logs, roles=("render", "prefill", "decode"))
    print(f"all healthy after {time.monotonic() - t0:.0f}s", flush=True)
    try:
        chat = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": QUESTION}],
                "max_tokens": 48, "temperature": 0, "stream": True}
        rid = uuid.uuid4().hex
        timings = {}

        t = time.perf_counter()
        gen = requests.post(sset.url("render") + wire.CHAT_RENDER, json=chat, timeout=60).json()
        timings["render"] = time.perf_counter() - t

        t = time.perf_counter()
        prefill = requests.post(sset.url("prefill") + wire.GENERATE, json=legs.prefill_leg(gen, get_connector("ExampleConnector")),
                                headers={wire.REQUEST_ID: rid}, timeout=60).json()
        timings["prefill"] = time.perf_counter() - t

        body = legs.decode_leg(gen, prefill.get(wire.KV_TRANSFER_PARAMS), output_mode="derender",
                               context={wire.CHAT_REQUEST: chat})
        print(f"\nuser: {QUESTION}\nassistant: ", end="", flush=True)
        t = time.perf_counter()
        first = None
        with requests.post(sset.url("decode") + wire.GENERATE, json=body, headers={wire.REQUEST_ID: rid},
                           stream=True, timeout=120) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices", []):
                    delta = choice.get("delta") or {}
                    text = (delta.get("reasoning") or "") + (delta.get("content") or "")
                    if text:
                        first = first or time.perf_counter()
                        print(text, end="", flush=True)
        timings["decode (first delta)"] = (first or time.perf_counter()) - t
        timings["decode (total)"] = time.perf_counter() - t
        print("\n\nper-leg timings:")
        for name, seconds in timings.items():
            print(f"  {name:22s} {seconds * 1000:8.1f} ms")
        return 0
    finally:
        sset.stop()


if __name__ == "__main__":
    sys.exit(main())
