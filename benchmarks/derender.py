"""Part 2, derender cost vs output length: one forced reasoning + tool-call answer of n tokens,
streamed through coupled vLLM, the sidecar with inline derender (decode runs the extension), the
sidecar chained to the derender tier's stateless endpoint (stock decode) with and without
coalescing, and the sidecar chained through a derender session on the render tier (stock decode;
the render server runs the extension); on the vLLM 0.34 lane, its coupled server and the sidecar
in front of its stock decode engine, which derenders its own stream (``stock-inline``), also with
``STOCK_STREAMS`` streams at once.

Per path and n: CPU of every non-engine process (vLLM API servers by pid, the sidecar, render),
bytes and calls between the sidecar and the render/derender tier (a counting pass-through), the
client's chunk count and largest gap, wall time; the answer is compared with coupled's of the
same round. The paths run alternately within each round."""

from __future__ import annotations

import json
from contextlib import ExitStack
from typing import Any

from benchmarks.client import run_load
from benchmarks.outputs import agent_chat, reasoning_tool_call_ids
from benchmarks.procs import CpuMeter
from benchmarks.stack import counting_proxy, max_output_tokens, sidecar, sidecar_config, traffic
from benchmarks.stats import paired_ratios, summary
from disagg_engine.sessions import CHAT_SESSION_PATH
from disagg_operator.engine_args import vllm_features
from tests.harness.openai_views import chat_stream_view

LENGTHS = (64, 256, 1024, 4096, 8192)
PATHS = ("coupled", "inline", "chained", "chained_nocoalesce", "session", "session_per_token")
# vLLM 0.34 (its lane's servers): a stock decode engine derenders its own stream from render's
# parse_context, as the operator configures a 0.34 model without the extension.
STOCK_LANE, STOCK_VERSION = "0.34", "0.34.0"
STOCK_PATHS = ("coupled_034", "stock_inline")
# The same pair with STOCK_STREAMS streams at once at the longest n: a decode pod's regime, where one
# wake-up of the sidecar relays the chunks of several streams.
STOCK_STREAMS = 8
STOCK_CONCURRENT = {f"{path}_x{STOCK_STREAMS}": path for path in STOCK_PATHS}  # path -> the single stream's
REFERENCE = {"coupled": None, "coupled_034": None, "stock_inline": "coupled_034",
             **{many: None if one == "coupled_034" else f"coupled_034_x{STOCK_STREAMS}"
                for many, one in STOCK_CONCURRENT.items()}}  # the rest: "coupled"
DERENDER = ("/v1/chat/completions/derender", CHAT_SESSION_PATH)  # stateless calls, sessions
LOCAL_PREFILL = {"mode": "local", "discovery": None}
# One derender call per token is slow (~10 ms of render CPU each here, more as n grows): longer
# answers take minutes per request on 2 cores. The coalescing paths run at every n.
NOCOALESCE_MAX = 256


def run(ctx) -> dict[str, Any]:
    sset, tok = ctx.servers(), ctx.tokenizer()
    lengths = [min(n, max_output_tokens(sset)) for n in ctx.sizes("lengths", LENGTHS)]
    rounds = ctx.sizes("rounds", 2)
    nocoalesce_max = ctx.sizes("nocoalesce_max", NOCOALESCE_MAX)
    pid = {role: sset.servers[role].pid for role in ("render", "decode", "coupled")}
    rows: dict[str, dict[int, list[dict[str, float]]]] = {p: {n: [] for n in lengths} for p in PATHS}
    mismatches: list[str] = []
    with counting_proxy(sset.url("render")) as tier_proxy:
        tier = {"render": {"url": tier_proxy.url}, "derender": {"url": tier_proxy.url}, "prefill": LOCAL_PREFILL}
        stock = {"decode": {"url": sset.url("coupled")}}  # coupled is also a stock --enable-scale-out engine
        stateless = {"derender_sessions": False}  # the render server offers sessions; these paths do not ask
        configs = {
            "inline": sidecar_config(sset, **tier),
            "chained": sidecar_config(sset, **tier, **stock, engine=stateless),
            "chained_nocoalesce": sidecar_config(sset, **tier, **stock, engine=stateless, limits={"coalesce": False}),
            # The sidecar's default limits.session_stream_interval (decode sends up to 4 tokens a chunk),
            # and a decode chunk per token: what the interval saves, and what it costs in gaps.
            "session": sidecar_config(sset, **tier, **stock, engine={"derender_sessions": True}),
            "session_per_token": sidecar_config(sset, **tier, **stock, engine={"derender_sessions": True},
                                                limits={"session_stream_interval": 1}),
        }
        with ExitStack() as running:
            side = {name: running.enter_context(sidecar(config)) for name, config in configs.items()}
            target = {"coupled": (sset.url("coupled"), {"api": pid["coupled"]})}
            for name, proc in side.items():
                api = pid["decode"] if name == "inline" else pid["coupled"]
                target[name] = (proc.url, {"api": api, "sidecar": proc.proc.pid, "render": pid["render"]})
            forced = {n: reasoning_tool_call_ids(n, tok) for n in lengths}
            bodies = {n: agent_chat(ids) for n, ids in forced.items()}
            # The session goal's floor: the generated token ids' JSON plus the client's request once.
            floor = {n: len(json.dumps(forced[n])) + len(json.dumps(bodies[n])) for n in lengths}
            for name, (url, _) in target.items():  # warm-up: connections, caches, the first parse
                run_load(url + "/v1/chat/completions", [agent_chat(reasoning_tool_call_ids(64, tok))])
            for r in range(rounds):
                for n in lengths:
                    want = None
                    for name in PATHS:
                        if name == "chained_nocoalesce" and n > nocoalesce_max:
                            continue
                        url, pids = target[name]
                        want = measure(ctx, f"r{r} n={n} {name}", url, pids, bodies[n], floor[n], tier_proxy,
                                       rows[name][n], want, mismatches)
    stock_lengths = [n for n in lengths if n <= max_output_tokens(ctx.lane_servers(STOCK_LANE))]
    for name in STOCK_PATHS:
        rows[name] = {n: [] for n in stock_lengths}
    for name in STOCK_CONCURRENT:
        rows[name] = {key_length(stock_lengths): []}
    run_stock(ctx, stock_lengths, rounds, bodies, floor, rows, mismatches)
    return summarise(rows, lengths, mismatches)


def run_stock(ctx, lengths: list[int], rounds: int, bodies: dict[int, dict], floor: dict[int, int],
              rows: dict[str, dict[int, list[dict[str, float]]]], mismatches: list[str]) -> None:
    """The 0.34 lane's pair, alternating per round: its coupled server, and a sidecar (render and
    derender tier behind the counting pass-through: it should see no derender call) in front of its
    stock decode engine (the lane's coupled server, a stock ``--enable-scale-out`` engine)."""
    lane = ctx.lane_servers(STOCK_LANE)
    pid = {role: lane.servers[role].pid for role in ("render", "coupled")}
    with counting_proxy(lane.url("render")) as tier_proxy:
        config = sidecar_config(lane, render={"url": tier_proxy.url}, derender={"url": tier_proxy.url},
                                prefill=LOCAL_PREFILL, decode={"url": lane.url("coupled")},
                                engine={"vllm_version": STOCK_VERSION, "extension": False, "derender_sessions": False,
                                        "features": vllm_features(STOCK_VERSION)})
        with sidecar(config) as proc:
            target = {"coupled_034": (lane.url("coupled"), {"api": pid["coupled"]}),
                      "stock_inline": (proc.url, {"api": pid["coupled"], "sidecar": proc.proc.pid, "render": pid["render"]})}
            for url, _ in target.values():
                run_load(url + "/v1/chat/completions", [bodies[min(bodies)]])
            for r in range(rounds):
                for n in lengths:
                    want = None
                    for name in STOCK_PATHS:
                        url, pids = target[name]
                        want = measure(ctx, f"r{r} n={n} {name}", url, pids, bodies[n], floor[n], tier_proxy,
                                       rows[name][n], want, mismatches)
                n = key_length(lengths)
                for name, side in STOCK_CONCURRENT.items():
                    url, pids = target[side]
                    measure_many(ctx, f"r{r} n={n} {name}", url, pids, bodies[n], floor[n], tier_proxy, rows[name][n])


def measure_many(ctx, label: str, url: str, pids: dict[str, int], body: dict, floor: int, tier_proxy: Any,
                 out: list[dict[str, float]]) -> None:
    """``STOCK_STREAMS`` copies of one streamed request to ``url`` at once: their chunks, bytes and
    calls, and the processes' CPU, together (the answer is the single stream's, compared there)."""
    meter = CpuMeter(pids)
    tier_proxy.calls.clear()
    meter.start()
    samples = run_load(url + "/v1/chat/completions", [body] * STOCK_STREAMS, STOCK_STREAMS)
    cpu = meter.stop()
    if bad := [s for s in samples if not s.ok]:
        raise RuntimeError(f"{label}: {bad[0].error}")
    out.append({"wall_s": max(s.latency for s in samples), "chunks": sum(s.chunks for s in samples),
                "max_gap_s": max((g for s in samples for g in s.gaps), default=0.0),
                "cpu_total_s": sum(cpu.values()), **{f"cpu_{k}_s": v for k, v in cpu.items()},
                **tier_traffic(traffic(tier_proxy.calls)), "bytes_floor": STOCK_STREAMS * floor})
    ctx.log(f"derender {label}: {STOCK_STREAMS} streams, chunks {out[-1]['chunks']} cpu {sum(cpu.values()):.2f}s")


def tier_traffic(moved: dict[str, Any]) -> dict[str, int]:
    """Calls and bytes between the sidecar and the render/derender tier (``stack.traffic``): those of
    derender (stateless calls and sessions) and the rest (the render leg)."""
    derender = [p for p in DERENDER if p in moved["calls"]]
    to, back = sum(moved["bytes_out"][p] for p in derender), sum(moved["bytes_in"][p] for p in derender)
    return {"derender_calls": sum(moved["calls"][p] for p in derender), "bytes_to_derender": to,
            "bytes_from_derender": back,
            "bytes_render_leg": sum(moved["bytes_out"].values()) + sum(moved["bytes_in"].values()) - to - back}


def measure(ctx, label: str, url: str, pids: dict[str, int], body: dict, floor: int, tier_proxy: Any,
            out: list[dict[str, float]], want: Any, mismatches: list[str]) -> Any:
    """One streamed request to ``url``: its row appended to ``out``; its view, which is ``want`` when
    it is the round's reference (``want`` None), else compared with it. Returns the reference view."""
    meter = CpuMeter(pids)
    tier_proxy.calls.clear()
    meter.start()
    (s,) = run_load(url + "/v1/chat/completions", [body], keep=True)
    cpu = meter.stop()
    moved = traffic(tier_proxy.calls)
    if not s.ok:
        raise RuntimeError(f"{label}: {s.error}")
    view = chat_stream_view(s.events)
    if want is None:
        want = view
    elif view != want:
        mismatches.append(label)
    out.append({
        "wall_s": s.latency, "chunks": s.chunks, "max_gap_s": max(s.gaps, default=0.0),
        "cpu_total_s": sum(cpu.values()), **{f"cpu_{k}_s": v for k, v in cpu.items()},
        **tier_traffic(moved), "bytes_floor": floor,
    })
    if " session" in label and moved["calls"].get(CHAT_SESSION_PATH) != 1:
        mismatches.append(f"{label}: {moved['calls']} (not one session)")
    ctx.log(f"derender {label}: wall {s.latency:.2f}s chunks {s.chunks} cpu {sum(cpu.values()):.2f}s "
            f"calls {moved['calls']}")
    return want


def key_length(lengths: list[int]) -> int:
    """The n the goals' keys are measured at: 4,096, or the longest when a run has no 4,096."""
    return 4096 if 4096 in lengths else max(lengths)


def bytes_growth(by_n: dict[int, dict[str, Any]]) -> float:
    """Bytes to derender per output token at the largest n over the same at the smallest n: 1 when
    they grow linearly, about n_max / n_min when each call resends everything before it."""
    ns = sorted(by_n)
    if len(ns) < 2:
        return float("nan")
    per_token = [by_n[n]["bytes_to_derender"]["median"] / n for n in (ns[0], ns[-1])]
    return per_token[1] / per_token[0] if per_token[0] else float("nan")


def per_call_growth(by_n: dict[int, dict[str, Any]]) -> float:
    """Bytes per derender call at the largest n over the smallest: > 1 when each call carries more
    the later it comes (state that grows with the answer)."""
    ns = sorted(by_n)
    if len(ns) < 2:
        return float("nan")
    per_call = [by_n[n]["bytes_to_derender"]["median"] / by_n[n]["derender_calls"]["median"] for n in (ns[0], ns[-1])]
    return per_call[1] / per_call[0] if per_call[0] else float("nan")


def summarise(rows: dict[str, dict[int, list[dict[str, float]]]], lengths: list[int],
              mismatches: list[str]) -> dict[str, Any]:
    """Medians with spread per path and n, per-round ratios to coupled, and the results.json keys."""
    table: dict[str, dict[int, dict[str, Any]]] = {}
    for path, by_n in rows.items():
        table[path] = {}
        for n, runs in by_n.items():
            if not runs:
                continue
            table[path][n] = {k: summary([r[k] for r in runs]) for k in runs[0]}
            reference = REFERENCE.get(path, "coupled")
            if reference is not None and rows[reference].get(n):
                coupled = rows[reference][n]
                table[path][n]["cpu_ratio"] = paired_ratios([r["cpu_total_s"] for r in runs],
                                                            [r["cpu_api_s"] for r in coupled])
                table[path][n]["chunks_ratio"] = paired_ratios([r["chunks"] for r in runs],
                                                               [r["chunks"] for r in coupled])
    keys: dict[str, float] = {}
    n = key_length(lengths)

    def med(path: str, field: str) -> float:
        return table.get(path, {}).get(n, {}).get(field, {}).get("median", float("nan"))

    # Named for the n measured: a run without 4,096 leaves the goals' keys unmeasured.
    keys[f"inline_cpu_ratio_{n}"] = med("inline", "cpu_ratio")
    keys[f"inline_chunks_ratio_{n}"] = med("inline", "chunks_ratio")
    keys[f"chained_cpu_ratio_{n}"] = med("chained", "cpu_ratio")
    keys[f"chained_client_chunks_ratio_{n}"] = med("chained", "chunks_ratio")
    keys[f"chained_bytes_per_token_{n}"] = med("chained", "bytes_to_derender") / n
    keys["chained_bytes_per_token_growth"] = bytes_growth(table.get("chained", {}))
    keys["chained_nocoalesce_bytes_per_call_growth"] = per_call_growth(table.get("chained_nocoalesce", {}))
    keys[f"session_cpu_ratio_{n}"] = med("session", "cpu_ratio")
    keys[f"session_client_chunks_ratio_{n}"] = med("session", "chunks_ratio")
    keys[f"session_bytes_ratio_{n}"] = med("session", "bytes_to_derender") / med("session", "bytes_floor")
    keys["session_bytes_per_token_growth"] = bytes_growth(table.get("session", {}))
    keys[f"session_per_token_cpu_ratio_{n}"] = med("session_per_token", "cpu_ratio")
    keys[f"stock_inline_cpu_ratio_{n}"] = med("stock_inline", "cpu_ratio")
    keys[f"stock_inline_chunks_ratio_{n}"] = med("stock_inline", "chunks_ratio")
    keys[f"stock_inline_derender_calls_{n}"] = med("stock_inline", "derender_calls")
    keys[f"stock_inline_x{STOCK_STREAMS}_cpu_ratio_{n}"] = med(f"stock_inline_x{STOCK_STREAMS}", "cpu_ratio")
    keys[f"stock_inline_x{STOCK_STREAMS}_chunks_ratio_{n}"] = med(f"stock_inline_x{STOCK_STREAMS}", "chunks_ratio")
    return {"keys": keys, "lengths": lengths, "nocoalesce_max": NOCOALESCE_MAX, "table": table, "mismatches": mismatches,
            "outputs_equal_coupled": not mismatches}
