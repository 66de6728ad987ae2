"""Per-token API-process CPU of streaming ``output_mode="derender"`` vs coupled chat streaming.

Both servers run the same model and forced tokens; the engine work is identical, so the number
that differs is the CPU of the API server process (detokenization + parsing + serialisation).
Prints the numbers and their ratio (goal: derender / coupled <= 1.1).

    .venv/bin/python -m benchmarks.engine_derender [--tokens 2048] [--runs 3]
    DISAGG_ATTACH_SERVERS=/path/servers.json ... attaches to a running harness set
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import requests

from benchmarks.outputs import reasoning_tool_call_ids
from benchmarks.procs import cpu_seconds
from disagg_engine.testing.server_set import start_server_set


def stream(url: str, body: dict) -> int:
    n = 0
    with requests.post(url, json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()

    attach = os.environ.get("DISAGG_ATTACH_SERVERS")
    if attach:
        desc = json.loads(Path(attach).read_text())["servers"]
        urls = {k: v["url"] for k, v in desc.items()}
        pids = {k: v["pid"] for k, v in desc.items()}
        model_dir = json.loads(Path(attach).read_text())["model_dir"]
        sset = None
    else:
        sset = start_server_set(Path(tempfile.mkdtemp(prefix="bench-logs-")), roles=("render", "decode", "coupled"))
        urls = {k: s.url for k, s in sset.servers.items()}
        pids = {k: s.pid for k, s in sset.servers.items()}
        model_dir = str(sset.model_dir)
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        ids = reasoning_tool_call_ids(args.tokens, tok)
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}}]
        chat = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "bench"}], "tools": tools,
                "max_tokens": len(ids) + 8, "vllm_xargs": {"forced_token_ids": ids}, "stream": True,
                "stream_options": {"include_usage": True}}
        gen = requests.post(urls["render"] + "/v1/chat/completions/render", json=chat, timeout=60).json()
        inline = {**gen, "output_mode": "derender", "chat_request": chat}

        paths = (
            ("coupled /v1/chat/completions", urls["coupled"] + "/v1/chat/completions", chat, pids["coupled"]),
            ("generate output_mode=derender", urls["decode"] + "/inference/v1/generate", inline, pids["decode"]),
        )
        totals = {name: [0.0, 0.0] for name, *_ in paths}
        for _, url, body, _ in paths:
            stream(url, body)  # warm-up
        for _ in range(args.runs):  # alternating, so drift in machine load hits both paths alike
            for name, url, body, pid in paths:
                c0, w0 = cpu_seconds(pid), time.perf_counter()
                stream(url, body)
                totals[name][0] += cpu_seconds(pid) - c0
                totals[name][1] += time.perf_counter() - w0
        results = {name: (cpu / args.runs, wall / args.runs) for name, (cpu, wall) in totals.items()}
        print(f"forced output: {len(ids)} tokens (reasoning + content + 1 tool call), {args.runs} runs each")
        for name, (cpu, wall) in results.items():
            print(f"  {name:32s} API-process CPU {cpu:6.3f} s  ({1e6 * cpu / len(ids):7.1f} us/token)  wall {wall:6.2f} s")
        (c_cpu, _), (d_cpu, _) = results.values()
        print(f"  ratio derender/coupled CPU per token: {d_cpu / c_cpu:.2f}x (goal <= 1.1x)")
    finally:
        if sset is not None:
            sset.stop()


if __name__ == "__main__":
    main()
