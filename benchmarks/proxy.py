"""Part 1, proxy overhead: the same short requests straight to the decode engine and through the
sidecar in front of it (prefill local, so only the proxy differs; a chat or Messages request
through the sidecar also takes its render leg), per API (``APIS``: chat, Anthropic Messages, OpenAI
Responses) and
generate, batch and streamed, at several concurrencies.

Per side, kind and concurrency: latency p50/p99, TTFT, inter-chunk time, throughput, and the
sidecar's CPU per request; separately the sidecar's CPU per relayed chunk (a long stream minus
the same answer in one piece, divided by the chunks). Sides alternate within each round."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import requests
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.client import Sample, run_load
from benchmarks.outputs import plain_ids, short_chat, short_message, short_response
from benchmarks.procs import cpu_seconds
from benchmarks.profile import profile
from benchmarks.stack import sidecar, sidecar_config
from benchmarks.stats import median, quantile, summary
from disagg_engine.servers import free_port

CONCURRENCY = (1, 16, 64)
SHORT_TOKENS = 16
CHUNK_STREAMS = 16  # streams at once for the per-chunk cost under load (a decode pod's many requests)
CHUNK_GOAL_US, REQUEST_GOAL_MS = 50.0, 0.5  # the goals bench/RESULTS.md checks
GENERATE = "/inference/v1/generate"
CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class ProxiedApi:
    """A client API the decode engine serves itself and the sidecar serves through its legs: the
    same request to both sides. ``request(ids, stream, i)``: one whose answer is the forced ``ids``."""

    path: str
    request: Callable[[list[int], bool, int], dict[str, Any]]


APIS = {"chat": ProxiedApi(CHAT, short_chat), "messages": ProxiedApi("/v1/messages", short_message),
        "responses": ProxiedApi("/v1/responses", short_response)}
# kind: an API's name (batch) or with ``_stream``; ``generate``: render's GenerateRequest for a chat.
KINDS = tuple(f"{api}{suffix}" for api in (*APIS, "generate") for suffix in ("", "_stream"))


def bodies(ctx, sset, kind: str, count: int, tokens: int) -> tuple[str, list[dict]]:
    ids = plain_ids(tokens, ctx.tokenizer())
    api, stream = kind.removesuffix("_stream"), kind.endswith("_stream")
    if api in APIS:
        return APIS[api].path, [APIS[api].request(ids, stream, i) for i in range(count)]
    render = sset.url("render") + "/v1/chat/completions/render"
    return GENERATE, [requests.post(render, json=short_chat(ids, stream, i), timeout=60).json() for i in range(count)]


def timed(url: str, reqs: list[dict], concurrency: int, pid: int | None) -> tuple[list[Sample], float, float]:
    """Samples, wall seconds, and the sidecar's CPU seconds (0 when direct)."""
    c0 = cpu_seconds(pid) if pid else 0.0
    t0 = time.perf_counter()
    samples = run_load(url, reqs, concurrency)
    wall = time.perf_counter() - t0
    bad = [s for s in samples if not s.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(samples)} requests failed: {bad[0].error}")
    return samples, wall, (cpu_seconds(pid) - c0) if pid else 0.0


def run(ctx) -> dict[str, Any]:
    sset = ctx.servers()
    rounds, per = ctx.sizes("rounds", 2), ctx.sizes("requests", 24)
    config = sidecar_config(sset, prefill={"mode": "local", "discovery": None})
    raw: dict[str, dict[int, dict[str, list[dict[str, Any]]]]] = {
        k: {c: {"direct": [], "sidecar": []} for c in ctx.sizes("concurrency", CONCURRENCY)} for k in KINDS}
    with sidecar(config) as side:
        sides = {"direct": (sset.url("decode"), None), "sidecar": (side.url, side.proc.pid)}
        for _, (base, _) in sides.items():  # warm-up
            for kind in KINDS:
                path, reqs = bodies(ctx, sset, kind, 4, SHORT_TOKENS)
                run_load(base + path, reqs, 4)
        for r in range(rounds):
            for kind in KINDS:
                for c in raw[kind]:
                    path, reqs = bodies(ctx, sset, kind, max(per, 2 * c), SHORT_TOKENS)
                    for name, (base, pid) in sides.items():
                        before = leg_seconds(side.url) if pid else {}
                        samples, wall, cpu = timed(base + path, reqs, c, pid)
                        legs = leg_ms_per_request(before, leg_seconds(side.url), len(samples)) if pid else {}
                        raw[kind][c][name].append({
                            "latency": [s.latency for s in samples], "ttft": [s.ttft for s in samples],
                            "gaps": [g for s in samples for g in s.gaps], "chunks": sum(s.chunks for s in samples),
                            "wall": wall, "requests": len(samples), "cpu": cpu, "legs_ms": legs})
                    d, s = raw[kind][c]["direct"][-1], raw[kind][c]["sidecar"][-1]
                    ctx.log(f"proxy r{r} {kind} c={c}: p50 direct {1e3 * median(d['latency']):.1f} ms, sidecar "
                            f"{1e3 * median(s['latency']):.1f} ms, sidecar CPU/req {1e3 * s['cpu'] / s['requests']:.2f} ms")
        with sidecar(shaping_config(config)) as shaping:
            chunk_cost = per_chunk_cpu(ctx, sset, side, shaping, rounds)
        result = summarise(raw, chunk_cost)
        keys = result["keys"]
        if keys["sidecar_cpu_us_per_chunk"] > CHUNK_GOAL_US or keys["sidecar_cpu_ms_per_request"] > REQUEST_GOAL_MS:
            # A goal missed: where the sidecar's CPU goes, under streams and short requests mixed.
            ids, short = plain_ids(512, ctx.tokenizer()), plain_ids(SHORT_TOKENS, ctx.tokenizer())
            mix = [short_chat(ids, True, i) if i % 4 == 0 else short_chat(short, False, i) for i in range(16)]

            def load(deadline: float) -> None:
                while time.monotonic() < deadline:
                    run_load(side.url + CHAT, mix, 8)

            result["profile"] = profile(side.proc.pid, load, ctx.out / "profile-sidecar.txt",
                                        seconds=ctx.sizes("profile_seconds", 20))
    return result


def leg_seconds(url: str) -> dict[str, tuple[float, float]]:
    """The sidecar's ``disagg_sidecar_leg_seconds`` per leg (all APIs): (sum, count)."""
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(requests.get(url + "/metrics", timeout=10).text):
        if family.name != "disagg_sidecar_leg_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith(("_sum", "_count")):
                acc = out.setdefault(sample.labels["leg"], [0.0, 0.0])
                acc[sample.name.endswith("_count")] += sample.value
    return {leg: (v[0], v[1]) for leg, v in out.items()}


def leg_ms_per_request(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]],
                       requests_: int) -> dict[str, float]:
    """Each leg's own time between two scrapes, in ms per client request."""
    return {leg: 1e3 * (after[leg][0] - before.get(leg, (0.0, 0.0))[0]) / requests_
            for leg in after if after[leg][1] > before.get(leg, (0.0, 0.0))[1]}


@contextmanager
def relay_floor(target: str) -> Iterator[tuple[str, int]]:
    """``benchmarks.relayfloor`` in front of ``target``, as its own process; its URL and pid."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.relayfloor", target, str(port)])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the relay floor did not start") from None
                time.sleep(0.1)  # polling for the port, bounded by the deadline
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def shaping_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with the decode engine's own chunks shaped by the sidecar (``client_streams`` off):
    the inline relay as it was before the engine wrote the client's chunks, for comparison."""
    caps = {"output_modes": ["tokens", "text", "derender"], "streaming_output_modes": ["tokens", "text", "derender"],
            "derender_context_forms": ["chat_request", "parse_context"], "client_streams": False}
    return {**config, "decode": {**config["decode"], "capabilities": caps}}


def per_chunk_cpu(ctx, sset, side, shaping, rounds: int) -> dict[str, Any]:
    """CPU of a long streamed answer minus the same answer in one piece, per relayed chunk: the
    sidecar's for a chat (inline: the engine writes the client's chunks, each checked and relayed as
    written), for the same chat with each chunk parsed, checked and reshaped (``shaping``: the engine
    writes generate chunks) and for a GenerateRequest (passed through: each event parsed and
    checked), and the relay floor's for the same GenerateRequest (``benchmarks.relayfloor``: bytes
    forwarded, nothing parsed). Sides alternate. Each round also runs the relayed chat and the floor
    with ``CHUNK_STREAMS`` streams at once (``concurrent``): a decode pod's regime, where one wake-up
    of the sidecar relays the chunks of several streams."""
    tokens = ctx.sizes("chunk_tokens", 512)
    ids = plain_ids(tokens, ctx.tokenizer())
    render = sset.url("render") + "/v1/chat/completions/render"
    out: dict[str, list[dict[str, Any]]] = {"chat": [], "chat_shaped": [], "generate": [], "floor": []}
    concurrent: dict[str, list[dict[str, Any]]] = {"chat": [], "floor": []}
    with relay_floor(sset.url("decode")) as (floor, floor_pid):
        sides = {"chat": (side.url + CHAT, side.proc.pid), "chat_shaped": (shaping.url + CHAT, shaping.proc.pid),
                 "generate": (side.url + GENERATE, side.proc.pid), "floor": (floor + GENERATE, floor_pid)}
        for r in range(max(rounds, 3)):
            chats = [short_chat(ids, False, r), short_chat(ids, True, r)]
            gens = [requests.post(render, json=c, timeout=60).json() for c in chats]
            for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                url, pid = sides[name]
                batch, stream = chats if name.startswith("chat") else gens
                _, _, batch_cpu = timed(url, [batch], 1, pid)
                samples, _, stream_cpu = timed(url, [stream], 1, pid)
                chunks = samples[0].chunks
                out[name].append({"chunks": chunks, "stream_cpu_s": stream_cpu, "batch_cpu_s": batch_cpu,
                                  "us_per_chunk": 1e6 * (stream_cpu - batch_cpu) / chunks,
                                  "us_per_chunk_upper": 1e6 * stream_cpu / chunks})
            for name in (list(concurrent) if r % 2 == 0 else list(concurrent)[::-1]):
                url, pid = sides[name]
                batch, stream = chats if name == "chat" else gens
                _, _, batch_cpu = timed(url, [batch] * CHUNK_STREAMS, CHUNK_STREAMS, pid)
                samples, _, stream_cpu = timed(url, [stream] * CHUNK_STREAMS, CHUNK_STREAMS, pid)
                chunks = sum(s.chunks for s in samples)
                concurrent[name].append({"chunks": chunks, "stream_cpu_s": stream_cpu, "batch_cpu_s": batch_cpu,
                                         "us_per_chunk": 1e6 * (stream_cpu - batch_cpu) / chunks})
    result = {"tokens": tokens, "runs": out["chat"], "us_per_chunk": summary([o["us_per_chunk"] for o in out["chat"]]),
              "us_per_chunk_upper": summary([o["us_per_chunk_upper"] for o in out["chat"]])}
    for name in ("chat_shaped", "generate", "floor"):
        result[name] = {"runs": out[name], "us_per_chunk": summary([o["us_per_chunk"] for o in out[name]])}
    result["concurrent"] = {"streams": CHUNK_STREAMS, **{
        name: {"runs": runs, "us_per_chunk": summary([o["us_per_chunk"] for o in runs])} for name, runs in concurrent.items()}}
    return result



def summarise(raw, chunk_cost: dict[str, Any]) -> dict[str, Any]:
    table: dict[str, dict[int, dict[str, Any]]] = {}
    for kind, by_c in raw.items():
        table[kind] = {}
        for c, sides in by_c.items():
            row: dict[str, Any] = {}
            for name, runs in sides.items():
                lat = [x for run in runs for x in run["latency"]]
                row[name] = {
                    "p50_ms": 1e3 * quantile(lat, 0.5), "p99_ms": 1e3 * quantile(lat, 0.99),
                    "ttft_p50_ms": 1e3 * quantile([x for run in runs for x in run["ttft"]], 0.5),
                    "chunk_gap_p50_ms": 1e3 * quantile([x for run in runs for x in run["gaps"]], 0.5),
                    "throughput_rps": summary([run["requests"] / run["wall"] for run in runs]),
                    "latency_ms": [1e3 * x for x in lat],
                }
            d, s = sides["direct"], sides["sidecar"]
            row["added_p50_ms"] = summary([1e3 * (quantile(b["latency"], 0.5) - quantile(a["latency"], 0.5))
                                           for a, b in zip(d, s)])
            row["added_p99_ms"] = summary([1e3 * (quantile(b["latency"], 0.99) - quantile(a["latency"], 0.99))
                                           for a, b in zip(d, s)])
            row["added_ttft_p50_ms"] = summary([1e3 * (quantile(b["ttft"], 0.5) - quantile(a["ttft"], 0.5))
                                                for a, b in zip(d, s)])
            # Beyond the legs' own time: the added p50 minus the render and prefill legs' mean time
            # per request (the decode leg is the direct side's whole answer).
            row["legs_ms"] = {leg: summary([b["legs_ms"].get(leg, 0.0) for b in s])
                              for leg in sorted({leg for b in s for leg in b["legs_ms"]})}
            row["added_beyond_legs_p50_ms"] = summary([
                1e3 * (quantile(b["latency"], 0.5) - quantile(a["latency"], 0.5))
                - sum(v for leg, v in b["legs_ms"].items() if leg in ("render", "prefill")) for a, b in zip(d, s)])
            row["throughput_ratio"] = summary([(b["requests"] / b["wall"]) / (a["requests"] / a["wall"])
                                               for a, b in zip(d, s)])
            row["sidecar_cpu_ms_per_request"] = summary([1e3 * b["cpu"] / b["requests"] for b in s])
            table[kind][c] = row
    keys = {key: value for api in APIS for key, value in api_keys(table, api).items()}
    keys.update({
        "sidecar_cpu_us_per_chunk": chunk_cost["us_per_chunk"]["median"],
        "sidecar_shaped_cpu_us_per_chunk": chunk_cost["chat_shaped"]["us_per_chunk"]["median"],
        "sidecar_generate_cpu_us_per_chunk": chunk_cost["generate"]["us_per_chunk"]["median"],
        "relay_floor_cpu_us_per_chunk": chunk_cost["floor"]["us_per_chunk"]["median"],
    })
    if many := chunk_cost.get("concurrent"):  # runs before it was measured have none
        keys[f"sidecar_cpu_us_per_chunk_c{many['streams']}"] = many["chat"]["us_per_chunk"]["median"]
        keys[f"relay_floor_cpu_us_per_chunk_c{many['streams']}"] = many["floor"]["us_per_chunk"]["median"]
    return {"keys": keys, "table": table, "chunk_cost": chunk_cost}


def api_keys(table: dict[str, dict[int, dict[str, Any]]], api: str) -> dict[str, float]:
    """One API's headline keys (medians over rounds): chat's keep their names, which the goals
    read (``benchmarks.goals``); another API's carry its name (``proxy_messages_added_p50_ms_c1``)."""
    tag = "" if api == "chat" else f"{api}_"
    rows = table[api]
    lo, hi = min(rows), max(rows)
    return {
        f"proxy_{tag}added_p50_ms_c{lo}": rows[lo]["added_p50_ms"]["median"],
        f"proxy_{tag}added_beyond_legs_p50_ms_c{lo}": rows[lo]["added_beyond_legs_p50_ms"]["median"],
        f"proxy_{tag}added_p99_ms_c{hi}": rows[hi]["added_p99_ms"]["median"],
        f"{tag}sidecar_cpu_ms_per_request": rows[lo]["sidecar_cpu_ms_per_request"]["median"],
        f"proxy_{tag}throughput_ratio_c{hi}": rows[hi]["throughput_ratio"]["median"],
        f"proxy_{tag}stream_throughput_ratio_c{hi}": table[f"{api}_stream"][hi]["throughput_ratio"]["median"],
    }
