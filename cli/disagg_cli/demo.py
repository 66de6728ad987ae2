"""``make demo``: ``disagg up examples/local-tiny.yaml``, one streamed chat answer, ``disagg down``.

Everything runs on this machine's CPU: render/derender, a tokens-only prefill engine, a decode
engine with Disagg's engine extension and the sidecar in front, started from the same plan the
operator builds. The request goes through the sidecar with the official ``openai`` SDK. The tiny
model has random weights, so the answer is chosen token by token with the test logits processor
(``vllm_xargs.forced_token_ids``); chat template, tokenization, KV hand-off, detokenization and the
reasoning parser are the real ones. Per-leg timings come from the sidecar's own metrics.

``--keep`` skips the ``disagg down`` and leaves the deployment running for more requests (``make demo
DEMO_ARGS=--keep``); the test suite uses it to run its local-mode tests on the demo's deployment.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from disagg_cli.local import commands, runner

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "local-tiny.yaml"
QUESTION = "What does disaggregated serving split, in one sentence?"
# Context long enough for the prompt to go to the prefill engine: the sidecar prefills prompts
# shorter than the KV connector can carry on decode itself (130 tokens with ExampleConnector on CPU).
SYSTEM = ("You answer questions about Disagg, which deploys vLLM's disaggregated serving on Kubernetes "
          "from one DisaggregatedModel spec. vLLM can split serving into tiers: render turns a chat "
          "request into prompt tokens with the chat template on a CPU; prefill computes the prompt's KV "
          "cache on a GPU; decode receives that KV cache, for example over NIXL or a shared directory, "
          "and generates the answer token by token; derender turns the generated tokens back into text, "
          "reasoning and tool calls with the same parsers a coupled server uses. A sidecar in each decode "
          "pod routes every request through the tiers and answers exactly as a coupled vllm serve would.")
ANSWER = ("<think>\nThe user wants the tiers.\n</think>\n\n"
          "Render, prefill, decode and derender each run where they are cheapest.")


def forced_ids(model_dir: Path, text: str) -> list[int]:
    """The model's tokenizer.json through ``tokenizers`` itself: the same ids as transformers'
    AutoTokenizer, without its ~12 s of import and load on a small CPU."""
    from tokenizers import Tokenizer

    from disagg_engine.testing.tiny_model import EOS

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return tok.encode(text, add_special_tokens=False).ids + [tok.token_to_id(EOS)]


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
    print(f"\nsystem: ({len(SYSTEM.split())} words of context about Disagg)", flush=True)
    print(f"user: {QUESTION}", flush=True)
    started = time.perf_counter()
    first = None
    usage = None
    section = None
    stream = client.chat.completions.create(
        model="tiny-qwen3", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        max_tokens=128, stream=True,
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


def main(argv: list[str] | None = None) -> int:
    from disagg_engine.testing.tiny_model import ensure_model

    ap = argparse.ArgumentParser(prog="python -m disagg_cli.demo", description="make demo's program")
    ap.add_argument("--keep", action="store_true", help="leave the deployment running (no `disagg down`)")
    ap.add_argument("--state-dir", type=Path, help="`disagg up --state-dir` (default: a temporary directory, "
                                                   "removed at the end unless --keep)")
    args = ap.parse_args(argv)
    forced = forced_ids(ensure_model(), ANSWER)
    name = runner.load_spec(EXAMPLE).name
    state = args.state_dir or Path(tempfile.mkdtemp(prefix="disagg-demo-"))
    print(f"disagg up {EXAMPLE.relative_to(Path.cwd()) if EXAMPLE.is_relative_to(Path.cwd()) else EXAMPLE}"
          f"  (vLLM on CPU: the first start takes a few minutes)", flush=True)
    try:
        # The CLI's own commands, so the demo runs exactly what a user types.
        code = commands.up_main([str(EXAMPLE), "--detach", "--state-dir", str(state)])
        if code == 0:
            chat(runner.Deployment.load(state / name).endpoint, forced)
        return code
    finally:
        up = (state / name / runner.STATE_FILE).exists()
        if up and args.keep:
            print(f"left running: disagg status --state-dir {state}; disagg down --state-dir {state}", flush=True)
        elif up:
            commands.down_main(["--state-dir", str(state), "--name", name])
        if args.state_dir is None and not (up and args.keep):
            shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
