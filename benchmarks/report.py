"""``bench/results.json`` and ``bench/RESULTS.md`` from every part's latest results
(``bench/parts/*.json``), and the plots."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from benchmarks.goals import check_all
from benchmarks.stats import fmt, fmt_spread, summary

ORDER = ("proxy", "derender", "serve", "operator", "soak", "prefix")


def load_parts(out: Path) -> dict[str, dict[str, Any]]:
    return {p: json.loads((out / "parts" / f"{p}.json").read_text()) for p in ORDER
            if (out / "parts" / f"{p}.json").exists()}


def clean(x: Any) -> Any:
    """NaN -> null, and no raw per-request samples (they stay in bench/parts/)."""
    if isinstance(x, float):
        return None if math.isnan(x) else round(x, 6)
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items() if k != "latency_ms"}
    if isinstance(x, list):
        return [clean(v) for v in x]
    return x


def results(parts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    keys: dict[str, Any] = {}
    for part in parts.values():
        keys.update(part.get("keys", {}))
    return clean({"keys": keys, "goals": check_all(keys), "runs": {p: r["meta"] for p, r in parts.items()},
                  "details": {p: {k: v for k, v in r.items() if k not in ("keys", "meta", "raw")} for p, r in parts.items()}})


def _goal_line(g: dict[str, Any]) -> str:
    if g["status"] == "not measured":
        return f"| {g['goal']} | {g['op']} {g['bound']} {g['unit']} | not measured (`{g['key']}`) | — |"
    value = f"{fmt(g['value'], 3)} {g['unit']}".strip()
    if g["status"] == "met":
        verdict = "**met**"
    else:
        factor = f" ({fmt(g['missed_by_factor'], 1)}×)" if g.get("missed_by_factor") else ""
        verdict = f"**missed** by {fmt(g['missed_by'], 3)} {g['unit']}{factor}".rstrip()
    return f"| {g['goal']} | {g['op']} {g['bound']} {g['unit']} | {value} | {verdict} |"


def _header(parts: dict[str, dict[str, Any]]) -> list[str]:
    metas = [r["meta"] for r in parts.values()]
    m = metas[0]["machine"]
    loads = {p: r["meta"]["machine"]["load_avg_at_start"] for p, r in parts.items()}
    shared = [p for p, la in loads.items() if la[0] > m["cores"]]
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, Linux {m['kernel']}.",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in metas[0]["versions"].items()) + ".",
        "Runs: " + "; ".join(f"`{p}` {r['meta']['started']} ({r['meta']['seconds']:.0f} s{', quick sizes' if r['meta']['quick'] else ''}"
                             f"{''.join(f', {k}={v}' for k, v in r['meta'].get('overrides', {}).items())}"
                             f"{', attached servers' if r['meta'].get('attached_servers') else ''})" for p, r in parts.items()) + ".",
        "Load average (1/5/15 min) when each part started: "
        + "; ".join(f"{p} {'/'.join(str(x) for x in la)}" for p, la in loads.items()) + ".",
    ]
    if shared:
        lines.append(f"**{', '.join(shared)} started with the load above the machine's {m['cores']} cores** (other "
                     "work, or the bench's previous part still ending): absolute times are inflated and noisy; the "
                     "ratios compare sides that ran alternately in one process, so noise hit both, but their spread "
                     "is wide.")
    return lines


def _proxy(r: dict[str, Any]) -> list[str]:
    lines = ["| kind | c | direct p50 / p99 ms | sidecar p50 / p99 ms | added p50 ms | added p99 ms | added TTFT p50 ms | "
             "chunk gap p50 ms (d / s) | throughput ratio | sidecar CPU ms/req |", "|---|---|---|---|---|---|---|---|---|---|"]
    for kind, by_c in r["table"].items():
        for c, row in by_c.items():
            d, s = row["direct"], row["sidecar"]
            lines.append(f"| {kind} | {c} | {fmt(d['p50_ms'], 1)} / {fmt(d['p99_ms'], 1)} | {fmt(s['p50_ms'], 1)} / "
                         f"{fmt(s['p99_ms'], 1)} | {fmt_spread(row['added_p50_ms'], 1)} | {fmt_spread(row['added_p99_ms'], 1)} | "
                         f"{fmt_spread(row['added_ttft_p50_ms'], 1)} | {fmt(d['chunk_gap_p50_ms'], 2)} / "
                         f"{fmt(s['chunk_gap_p50_ms'], 2)} | {fmt_spread(row['throughput_ratio'])} | "
                         f"{fmt_spread(row['sidecar_cpu_ms_per_request'])} |")
    per_leg = []
    for kind, by_c in r["table"].items():
        row = by_c[min(by_c, key=int)]
        if "legs_ms" in row:  # runs before the legs were timed have none
            legs = ", ".join(f"{leg} {fmt_spread(v, 2)}" for leg, v in row["legs_ms"].items())
            per_leg.append(f"{kind}: legs {legs}; added p50 {fmt_spread(row['added_p50_ms'], 1)}, beyond the render "
                           f"and prefill legs {fmt_spread(row['added_beyond_legs_p50_ms'], 1)}")
    if per_leg:
        lines += ["", "At the lowest concurrency, each leg's own time in ms per request (the sidecar's "
                  "`disagg_sidecar_leg_seconds`; decode to its last byte) and the added p50 in ms: "
                  + "; ".join(per_leg) + "."]
    cc = r["chunk_cost"]
    lines += ["", f"Sidecar CPU per relayed chunk ({cc['tokens']}-token chat stream minus the same answer in one piece): "
              f"{fmt_spread(cc['us_per_chunk'], 1)} µs; all of the stream's sidecar CPU per chunk: "
              f"{fmt_spread(cc['us_per_chunk_upper'], 1)} µs."]
    if "chat_shaped" in cc:  # runs before the engine wrote the client's chunks have none
        lines += ["", f"The decode engine writes the client's chunks (`client_stream`), which the sidecar checks and "
                  f"relays as written; the same chat with the engine's generate chunks parsed, checked and reshaped "
                  f"by the sidecar (`client_streams` off): {fmt_spread(cc['chat_shaped']['us_per_chunk'], 1)} µs "
                  f"per chunk."]
    if "floor" in cc:  # runs before the relay floor was measured have none
        lines += ["", f"The same answer as a streamed GenerateRequest, per chunk: through the sidecar (each event "
                  f"parsed and checked, its bytes passed on) {fmt_spread(cc['generate']['us_per_chunk'], 1)} µs; "
                  f"through a bare aiohttp relay that parses nothing (`benchmarks/relayfloor.py`, the floor of "
                  f"this stack on this machine) {fmt_spread(cc['floor']['us_per_chunk'], 1)} µs. The same answer in "
                  f"one piece, CPU per request: sidecar {fmt_spread(summary([1e3 * x['batch_cpu_s'] for x in cc['generate']['runs']]))} ms, "
                  f"floor {fmt_spread(summary([1e3 * x['batch_cpu_s'] for x in cc['floor']['runs']]))} ms."]
    if many := cc.get("concurrent"):  # runs before it was measured have none
        lines += ["", f"With {many['streams']} such streams at once (a decode pod's regime: one wake-up of the sidecar "
                  f"relays the chunks of several streams), per chunk: the relayed chat "
                  f"{fmt_spread(many['chat']['us_per_chunk'], 1)} µs, the floor {fmt_spread(many['floor']['us_per_chunk'], 1)} µs."]
    if prof := r.get("profile"):
        if "error" in prof:
            lines += ["", f"Profile: {prof['error']}"]
        else:
            lines += ["", f"**Profile of the sidecar** (py-spy, GIL-holding samples, mixed short requests and streams; "
                      f"collapsed stacks in `bench/{prof['file']}`). Share of samples where the function is the leaf "
                      "(self) and anywhere on the stack (total):", "", "| self % | function | | total % | function |",
                      "|---|---|---|---|---|"]
            for (sf, sp), (tf, tp) in zip(prof["self"][:12], prof["total"][:12]):
                lines.append(f"| {sp} | `{sf}` | | {tp} | `{tf}` |")
    return lines


def _derender(r: dict[str, Any]) -> list[str]:
    lines = ["Medians (min-max) per request; CPU = vLLM API process(es) + sidecar + render, engines excluded; "
             "ratios per round against coupled's API CPU and chunks. chained: the stateless "
             "`/v1/chat/completions/derender` (calls = its calls); session: one derender session per stream "
             "(calls = 1; bytes → = the lines the sidecar writes into it, bytes ← = the events it answers).", "",
             "| path | n | wall s | client chunks | max gap s | CPU s | CPU ÷ coupled | chunks ÷ coupled | derender calls | "
             "bytes → derender | bytes ← derender | bytes/token → |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for path, by_n in r["table"].items():
        for n, row in by_n.items():
            ratio = fmt_spread(row["cpu_ratio"]) if "cpu_ratio" in row else "1"
            chunks = fmt_spread(row["chunks_ratio"]) if "chunks_ratio" in row else "1"
            lines.append(f"| {path} | {n} | {fmt_spread(row['wall_s'])} | {fmt(row['chunks']['median'], 0)} | "
                         f"{fmt(row['max_gap_s']['median'], 3)} | {fmt_spread(row['cpu_total_s'])} | {ratio} | {chunks} | "
                         f"{fmt(row['derender_calls']['median'], 0)} | {fmt(row['bytes_to_derender']['median'], 0)} | "
                         f"{fmt(row['bytes_from_derender']['median'], 0)} | "
                         f"{fmt(row['bytes_to_derender']['median'] / int(n), 1)} |")
    lines += ["", "Outputs equal to coupled's in the same round: "
              + ("all" if r["outputs_equal_coupled"] else f"**no**: {', '.join(r['mismatches'])}") + "."]
    return lines


def _serve(r: dict[str, Any]) -> list[str]:
    s = r["settings"]
    lines = [f"`vllm bench serve` (module entry point `benchmarks/vllm_bench_serve.py`), backend {s['backend']}, dataset "
             f"{s['dataset']} (input {s['input_len']}, output {s['output_len']} tokens, ignore_eos, seed {s['seed']}), "
             f"at least {s['prompts']} prompts. Coupled: one vLLM server; sidecar: render + remote prefill + decode.", "",
             "| c | side | output tok/s | TTFT p50 ms | TPOT p50 ms | failed |", "|---|---|---|---|---|---|"]
    for c, row in r["table"].items():
        for side in ("coupled", "sidecar"):
            x = row[side]
            lines.append(f"| {c} | {side} | {fmt_spread(x['output_throughput'], 1)} | {fmt_spread(x['median_ttft_ms'], 0)} | "
                         f"{fmt_spread(x['median_tpot_ms'], 1)} | {fmt(x['failed']['max'], 0)} |")
        lines.append(f"| {c} | **sidecar ÷ coupled** | {fmt_spread(row['ratio_output_throughput'])} | "
                     f"{fmt_spread(row['ratio_median_ttft_ms'])} | {fmt_spread(row['ratio_median_tpot_ms'])} | |")
    return lines


def _operator(r: dict[str, Any]) -> list[str]:
    lines = ["| models | objects | children applied s | statuses written s | kubectl --server-side s | ratio | "
             "operator CPU s (busy) | idle CPU % | RSS MB |", "|---|---|---|---|---|---|---|---|---|"]
    for x in r["runs"]:
        lines.append(f"| {x['models']} | {x['objects']} | {fmt(x['children_seconds'], 1)} | {fmt(x['status_seconds'], 1)} | "
                     f"{fmt(x['kubectl_server_side_seconds'], 1)} | {fmt(x['ratio_to_kubectl'])} | {fmt(x['operator_cpu_s'], 1)} | "
                     f"{fmt(x['idle_cpu_percent'], 1)} | {fmt(x['rss_mb'], 0)} |")
    a = r.get("operator_at_start", {})
    lines += ["", f"Operator at rest before any model: idle CPU {fmt(a.get('idle_cpu_percent', float('nan')), 1)}%, "
              f"RSS {fmt(a.get('rss_mb', float('nan')), 0)} MB."]
    return lines


def _soak(r: dict[str, Any]) -> list[str]:
    k = r["keys"]
    return [f"{r['streams']} concurrent chat streams ({r['answer_tokens']} tokens each, back to back) for {r['seconds']:.0f} s "
            f"through one sidecar (render + remote prefill + decode): {k['soak_requests']} streams, {r['chunks']} chunks, "
            f"**{k['soak_errors']} errors**" + (f" (e.g. {r['error_samples'][0]})" if r["error_samples"] else "") + ".",
            f"Sidecar RSS: {fmt(r['rss_mb']['early'], 1)} MB at 10 s, {fmt(r['rss_mb']['end'], 1)} MB at the end "
            f"(growth {fmt(k['soak_rss_growth_mb'], 2)} MB, {fmt(100 * k['soak_rss_growth_ratio'], 1)}%).",
            f"Footprint before: {r['base']}; after the load: {r['after']} "
            f"(back to base {fmt(k['soak_settle_seconds'], 1)} s after the last stream)."]


def _prefix(r: dict[str, Any]) -> list[str]:
    k = r["keys"]
    lines = [f"{r['conversations']} conversations × {r['turns']} turns ({r['answer_tokens']}-token answers, a shared "
             f"system prompt), all conversations' next turn at once, through one sidecar in front of two prefill "
             f"engines; {r['rounds']} rounds, the sides alternating, fresh conversations per side and round. Prefix-cache "
             f"hit rate (prefill engines, tokens): **prefix-affinity {fmt(k['prefix_hit_rate_prefix_affinity'])}** vs "
             f"least-requests {fmt(k['prefix_hit_rate_least_requests'])}; {k['prefix_errors']} errors. The share bound "
             f"(docs/llm-d.md) caps the busiest engine of a round as shown.", "",
             "| round | selection | hit rate | requests per prefill engine | share bound: busiest ≤ |", "|---|---|---|---|---|"]
    for i, x in enumerate(r["runs"]):
        cap = max(x["requests_per_engine"]) - x["over_share_cap"] if "over_share_cap" in x else None
        lines.append(f"| {i // 2} | {x['selection']} | {fmt(x['hit_rate'])} | {x['requests_per_engine']} | "
                     f"{fmt(cap, 0) if cap is not None and x['selection'] == 'prefix-affinity' else '-'} |")
    return lines


SECTIONS = {"proxy": ("1. Proxy overhead", _proxy), "derender": ("2. Derender cost vs output length", _derender),
            "serve": ("3. Real load client: vllm bench serve", _serve), "operator": ("4. Operator", _operator),
            "soak": ("5. Soak", _soak), "prefix": ("6. Prefix-aware prefill selection", _prefix)}


def markdown(parts: dict[str, dict[str, Any]], res: dict[str, Any], plots: list[str], notes: str = "") -> str:
    lines = ["# Benchmark results", "", "Written by `make bench` (`python -m benchmarks.run`, benchmarks/); each part "
             "alone with `make bench BENCH=<part>`. Every figure is a median over repeated runs with its spread "
             "(min-max, n); each comparison runs its sides alternately in one process.", "", *_header(parts), "",
             *([notes.strip(), ""] if notes.strip() else []),
             "## Goals", "", "| goal | bound | measured | verdict |", "|---|---|---|---|"]
    lines += [_goal_line(g) for g in res["goals"]]
    lines += ["", "Keys: `bench/results.json` (`keys`)."]
    for name, (title, fn) in SECTIONS.items():
        if name in parts:
            lines += ["", f"## {title}", "", *fn(parts[name])]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def write_all(out: Path) -> None:
    parts = load_parts(out)
    if not parts:
        return
    res = results(parts)
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    try:
        from benchmarks.plots import write as write_plots

        plots = write_plots(parts, out)
    except ImportError as exc:  # matplotlib comes with benchmarks/setup
        print(f"no plots: {exc}")
        plots = []
    notes = out / "notes.md"  # by hand: what the numbers cannot say about the run (kept across runs)
    (out / "RESULTS.md").write_text(markdown(parts, res, plots, notes.read_text() if notes.exists() else ""))
