"""Part 3, real load client: vLLM's own ``vllm bench serve`` (benchmarks/vllm_bench_serve.py)
against the sidecar (the whole disaggregated path: render, remote prefill with KV hand-over,
decode) and against the coupled server, with the same random dataset and seed, alternately:
throughput, TTFT, TPOT and their ratios (sidecar / coupled)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.stack import sidecar, sidecar_config
from benchmarks.stats import paired_ratios, summary

CONCURRENCY = (16, 64)
FIELDS = ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
          "p99_tpot_ms", "median_itl_ms", "completed", "failed")


def bench_serve(base_url: str, tokenizer: str, concurrency: int, prompts: int, out: Path,
                input_len: int = 128, output_len: int = 64) -> dict[str, Any]:
    from benchmarks.vllm_bench_serve import run as vllm_bench_serve

    argv = ["--backend", "openai-chat",
            "--base-url", base_url, "--endpoint", "/v1/chat/completions", "--model", "tiny-qwen3",
            "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--num-prompts", str(prompts), "--max-concurrency",
            str(concurrency), "--seed", "0", "--ignore-eos", "--disable-tqdm", "--num-warmups", "2",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    result = vllm_bench_serve(argv)
    if not result.get("completed"):
        raise RuntimeError(f"vllm bench serve completed nothing: {result}")
    return {k: result.get(k) for k in FIELDS}


def run(ctx) -> dict[str, Any]:
    sset = ctx.servers()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the tokenizer is the local model's
    rounds, prompts = ctx.sizes("rounds", 2), ctx.sizes("prompts", 64)
    raw: dict[int, dict[str, list[dict[str, Any]]]] = {c: {"coupled": [], "sidecar": []}
                                                      for c in ctx.sizes("concurrency", CONCURRENCY)}
    with sidecar(sidecar_config(sset)) as side, tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        targets = {"coupled": sset.url("coupled"), "sidecar": side.url}
        for r in range(rounds):
            for c in raw:
                for name, url in targets.items():
                    res = bench_serve(url, str(sset.model_dir), c, max(prompts, 2 * c), Path(tmp) / f"{name}-{c}-{r}.json")
                    raw[c][name].append(res)
                    ctx.log(f"serve r{r} c={c} {name}: {res['output_throughput']:.1f} tok/s, TTFT p50 "
                            f"{res['median_ttft_ms']:.0f} ms, TPOT p50 {res['median_tpot_ms']:.1f} ms, failed {res['failed']}")
    table: dict[int, dict[str, Any]] = {}
    for c, sides in raw.items():
        row: dict[str, Any] = {name: {k: summary([r[k] for r in runs]) for k in FIELDS} for name, runs in sides.items()}
        for k in ("output_throughput", "median_ttft_ms", "median_tpot_ms"):
            row[f"ratio_{k}"] = paired_ratios([r[k] for r in sides["sidecar"]], [r[k] for r in sides["coupled"]])
        table[c] = row
    keys = {f"bench_serve_throughput_ratio_c{c}": row["ratio_output_throughput"]["median"] for c, row in table.items()}
    keys.update({f"bench_serve_ttft_ratio_c{c}": row["ratio_median_ttft_ms"]["median"] for c, row in table.items()})
    keys.update({f"bench_serve_tpot_ratio_c{c}": row["ratio_median_tpot_ms"]["median"] for c, row in table.items()})
    return {"keys": keys, "table": table, "raw": raw,
            "settings": {"dataset": "random", "input_len": 128, "output_len": 64, "seed": 0, "ignore_eos": True,
                         "backend": "openai-chat", "prompts": prompts}}
