"""``make demo``: ``disagg up examples/local-tiny.yaml``, one streamed chat answer, shut down.

Everything runs on this machine's CPU: render/derender, a tokens-only prefill engine, a decode
engine with Disagg's engine extension and the sidecar in front, started from the same plan the
operator builds. The request goes through the sidecar with the official ``openai`` SDK. The tiny
model has random weights, so the answer is chosen token by token with the test logits processor
(``vllm_xargs.forced_token_ids``); chat template, tokenization, KV hand-off, detokenization and the
reasoning parser are the real ones. Per-leg timings come from the sidecar's own metrics.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from disagg_cli.local import runner
from disagg_engine.servers import stop_all

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "local-tiny.yaml"
QUESTION = "What does disaggregated serving split, in one sentence?"
ANSWER = ("<think>\nThe user wants the tiers.\n</think>\n\n"
          "Render, prefill, decode and derender each run where they are cheapest.")


def forced_ids(model_dir: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


def leg_seconds(endpoint: str) -> dict[str, float]:
    """Sum of ``disagg_sidecar_leg_seconds`` by leg (one request so far: its own leg times)."""
    with urllib.request.urlopen(endpoint + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    legs: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("disagg_sidecar_leg_seconds_sum{"):
            leg = line.split('leg="', 1)[1].split('"', 1)[0]
            legs[leg] = float(line.rsplit(" ", 1)[1])
    return legs


def chat(endpoint: str, forced: list[int]) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=endpoint + "/v1", api_key="unused")
    print(f"\nuser: {QUESTION}", flush=True)
    started = time.perf_counter()
    first = None
    usage = None
    section = None
    stream = client.chat.completions.create(
        model="tiny-qwen3", messages=[{"role": "user", "content": QUESTION}], max_tokens=128, stream=True,
        stream_options={"include_usage": True}, extra_body={"vllm_xargs": {"forced_token_ids": forced}})
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            for kind in ("reasoning", "content"):
                text = getattr(choice.delta, kind, None) or (choice.delta.model_extra or {}).get(kind)
                if not text:
                    continue
                first = first or time.perf_counter()
                if section != kind:
                    section = kind
                    print(f"\n{'assistant (reasoning)' if kind == 'reasoning' else 'assistant'}: ", end="")
                    text = text.lstrip()  # the template's newlines after <think> / </think>
                print(text, end="", flush=True)
    total = time.perf_counter() - started
    print("\n")
    if usage:
        print(f"usage: prompt {usage.prompt_tokens}, completion {usage.completion_tokens} tokens")
    print("timings (client side):")
    print(f"  {'first token':22s} {(first or started) - started:8.3f} s")
    print(f"  {'whole answer':22s} {total:8.3f} s")
    print("per-leg timings (sidecar metrics; decode runs to the last byte):")
    for leg, seconds in leg_seconds(endpoint).items():
        print(f"  {leg:22s} {seconds:8.3f} s")


def main() -> int:
    from disagg_engine.testing.tiny_model import ensure_model

    forced = forced_ids(ensure_model(), ANSWER)
    state = Path(tempfile.mkdtemp(prefix="disagg-demo-"))
    print(f"disagg up {EXAMPLE.relative_to(Path.cwd()) if EXAMPLE.is_relative_to(Path.cwd()) else EXAMPLE}"
          f"  (vLLM on CPU: the first start takes a few minutes)", flush=True)
    try:
        deployment, servers = runner.up(EXAMPLE, state_root=state)
    except BaseException:
        shutil.rmtree(state, ignore_errors=True)
        raise
    print(f"endpoint: {deployment.endpoint}", flush=True)
    try:
        chat(deployment.endpoint, forced)
        return 0
    finally:
        stopped = runner.down(Path(deployment.state_dir))
        stop_all(servers)  # reaps our children
        shutil.rmtree(state, ignore_errors=True)
        print(f"stopped {len(stopped)} processes", flush=True)


if __name__ == "__main__":
    sys.exit(main())
