"""The benchmarks' pure parts: statistics, goal verdicts, profile summaries, growth and settling checks, the
prefix part's share bound."""

from __future__ import annotations

import math
import random

from benchmarks.derender import bytes_growth, summarise, tier_traffic
from benchmarks.goals import Goal, check_all
from benchmarks.prefix import share_cap
from benchmarks.profile import collapsed_top
from benchmarks.soak import Footprint
from benchmarks.stats import paired_ratios, quantile, summary
from disagg_sidecar.upstream.endpoints import EndpointPool


def test_quantiles_interpolate_and_summary_keeps_the_spread() -> None:
    assert quantile([4, 1, 3, 2], 0.5) == 2.5
    assert quantile([1, 2, 3, 4, 5], 0.99) == 4.96
    assert math.isnan(quantile([], 0.5))
    s = summary([3.0, 1.0, 2.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.0, 1.0, 3.0, 3)


def test_paired_ratios_pair_rounds() -> None:
    assert paired_ratios([2.0, 6.0], [1.0, 2.0])["median"] == 2.5


def test_goal_verdicts_say_by_how_much() -> None:
    upper = Goal("cpu", "k", "<=", 50.0, "µs")
    assert upper.check({"k": 40.0})["status"] == "met"
    missed = upper.check({"k": 200.0})
    assert missed["status"] == "missed" and missed["missed_by"] == 150.0 and missed["missed_by_factor"] == 4.0
    lower = Goal("tput", "k", ">=", 0.95)
    assert lower.check({"k": 0.5})["missed_by"] == 0.95 - 0.5
    assert lower.check({})["status"] == "not measured"
    assert lower.check({"k": float("nan")})["status"] == "not measured"
    assert len(check_all({})) == len({g["key"] for g in check_all({})})


def test_collapsed_stacks_give_self_and_total_shares() -> None:
    top = collapsed_top(["main;relay;encode 3", "main;relay 1", "garbage", "main;parse 4"])
    assert dict(top["self"]) == {"encode": 37.5, "relay": 12.5, "parse": 50.0}
    assert dict(top["total"])["main"] == 100.0 and dict(top["total"])["relay"] == 50.0
    assert collapsed_top([]) == {"self": [], "total": []}


def test_bytes_growth_tells_linear_from_quadratic() -> None:
    def table(bytes_at):
        return {n: {"bytes_to_derender": {"median": bytes_at(n)}} for n in (256, 1024, 4096)}

    assert bytes_growth(table(lambda n: 300 * n)) == 1.0
    assert bytes_growth(table(lambda n: n * n)) == 16.0
    assert math.isnan(bytes_growth({256: {"bytes_to_derender": {"median": 1.0}}}))


def test_the_concurrent_stock_rows_are_ratios_to_coupled_with_as_many_streams() -> None:
    def row(cpu: float, chunks: int, api: float | None = None) -> dict[str, float]:
        return {"wall_s": 1.0, "chunks": chunks, "max_gap_s": 0.1, "cpu_total_s": cpu, "cpu_api_s": cpu if api is None else api,
                "derender_calls": 0, "bytes_to_derender": 0, "bytes_from_derender": 0, "bytes_render_leg": 0,
                "bytes_floor": 1}
    rows = {"coupled": {4096: [row(2.0, 4000)]}, "coupled_034": {4096: [row(2.0, 4000)]},
            "stock_inline": {4096: [row(3.0, 4000, api=2.0)]},
            "coupled_034_x8": {4096: [row(10.0, 32000)]}, "stock_inline_x8": {4096: [row(11.0, 31000, api=10.0)]}}
    keys = summarise(rows, [256, 4096], [])["keys"]
    assert keys["stock_inline_cpu_ratio_4096"] == 1.5
    assert keys["stock_inline_x8_cpu_ratio_4096"] == 1.1  # against coupled's 8 streams, not its one
    assert keys["stock_inline_x8_chunks_ratio_4096"] == 31000 / 32000


def test_tier_traffic_tells_derender_calls_from_the_render_leg() -> None:
    moved = {"calls": {"/v1/chat/completions/derender": 3, "/v1/chat/completions/render": 1},
             "bytes_out": {"/v1/chat/completions/derender": 30, "/v1/chat/completions/render": 5},
             "bytes_in": {"/v1/chat/completions/derender": 60, "/v1/chat/completions/render": 7}}
    assert tier_traffic(moved) == {"derender_calls": 3, "bytes_to_derender": 30, "bytes_from_derender": 60,
                                   "bytes_render_leg": 12}
    render_only = {"calls": {"/v1/chat/completions/render": 1}, "bytes_out": {"/v1/chat/completions/render": 5},
                   "bytes_in": {"/v1/chat/completions/render": 7}}
    assert tier_traffic(render_only) == {"derender_calls": 0, "bytes_to_derender": 0, "bytes_from_derender": 0,
                                         "bytes_render_leg": 12}


def test_footprint_settles_only_without_clients_requests_or_extra_threads() -> None:
    base = Footprint(client_connections=0, upstream_connections=4, upstream_endpoints=3, threads=1, fds=11, in_flight=0)
    # The health checker may hold two connections per endpoint.
    assert Footprint(0, 6, 3, 1, 13, 0).settled(base)
    assert not Footprint(1, 4, 3, 1, 12, 0).settled(base)      # a client connection left
    assert not Footprint(0, 4, 3, 1, 11, 1).settled(base)      # a request still counted
    assert not Footprint(0, 4, 3, 2, 11, 0).settled(base)      # a thread more
    assert not Footprint(0, 40, 3, 1, 47, 0).settled(base)     # upstream connections leaked
    assert not Footprint(0, 4, 3, 1, 30, 0).settled(base)      # file descriptors leaked


def test_the_share_cap_of_a_round_bounds_what_a_fresh_sidecar_sends_one_engine() -> None:
    # 80 legs, 2 engines, 125% of the last 64: 64 legs hold at most 40, the first 16 at most 10.
    assert share_cap(80, 2) == 50 and share_cap(12, 2) == 8 and share_cap(64, 2) == 40
    rng = random.Random(3)
    hot = [rng.randrange(10, 150_000) for _ in range(300)]  # one prompt: affinity wants one engine for all
    for legs in (12, 80, 200):
        pool = EndpointPool("prefill", lambda: ("a", "b"), "prefix-affinity", block_tokens=16)
        picks = [pool.pick(prompt=hot) for _ in range(legs)]
        assert max(picks.count("a"), picks.count("b")) <= share_cap(legs, 2)
