"""The planner's signals (operator/disagg_operator/signals.py): expositions in prometheus_client's own
text format with vLLM's family names, quantiles as Prometheus computes them, the PromQL."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from disagg_operator import signals as sig
from disagg_operator.decide import Signals

BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0)


class Engine:
    """A registry with the families vLLM's loggers.py exports, per engine (data-parallel rank)."""

    def __init__(self, ranks: int = 1, kv_name: str = "vllm:kv_cache_usage_perc") -> None:
        self.registry = r = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.waiting = Gauge("vllm:num_requests_waiting", "waiting", labels, registry=r)
        self.kv = Gauge(kv_name, "kv", labels, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "ttft", labels, buckets=BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "itl", labels, buckets=BUCKETS, registry=r)
        self.ranks = [str(i) for i in range(ranks)]

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def test_gauges_are_summed_and_averaged_over_ranks() -> None:
    e = Engine(ranks=2)
    for rank, (waiting, kv) in zip(e.ranks, [(3, 0.5), (4, 0.7)]):
        e.waiting.labels("m", rank).set(waiting)
        e.kv.labels("m", rank).set(kv)
    reading = sig.parse_engine(e.text())
    assert reading.waiting == 7 and reading.kv_usage == pytest.approx(0.6)


def test_older_vllm_names_its_kv_gauge_gpu_cache_usage() -> None:
    e = Engine(kv_name="vllm:gpu_cache_usage_perc")
    e.kv.labels("m", "0").set(0.25)
    assert sig.parse_engine(e.text()).kv_usage == 0.25


def test_missing_families_are_none_and_garbage_is_refused() -> None:
    empty = sig.parse_engine("")
    assert (empty.waiting, empty.kv_usage, empty.ttft, empty.itl) == (None, None, (), ())
    with pytest.raises(ValueError):
        sig.parse_engine("this is { not an exposition")


@pytest.mark.parametrize("buckets,want", [
    # 10 observations: 9 at or below 0.1 s (of which 5 below 0.05), 1 up to 0.5. p90 = rank 9 → 0.1.
    (((0.05, 5), (0.1, 9), (0.5, 10), (math.inf, 10)), 0.1),
    # rank 18 of 20, all 20 in (0.05, 0.1]: 0.05 + 0.05 * 18/20.
    (((0.05, 0), (0.1, 20), (math.inf, 20)), 0.095),
    # rank 18 of 20 in (0.1, 0.5], which holds observations 16..20: 0.1 + 0.4 * 3/5.
    (((0.05, 5), (0.1, 15), (0.5, 20), (math.inf, 20)), 0.34),
    # beyond the last finite bound: that bound, as Prometheus answers.
    (((0.05, 0), (0.1, 0), (math.inf, 10)), 0.1),
    ((), None),  # no histogram
    (((0.1, 0), (math.inf, 0)), 0.0),  # no requests: nothing waited
])
def test_quantile(buckets: sig.Buckets, want: float | None) -> None:
    got = sig.quantile(0.9, buckets)
    assert got == (pytest.approx(want) if want is not None else None)


def test_latency_is_over_the_interval_between_readings_and_survives_restarts() -> None:
    prefill, decode = Engine(), Engine()
    for _ in range(100):  # an old, slow past
        prefill.ttft.labels("m", "0").observe(0.9)
        decode.itl.labels("m", "0").observe(0.9)
    before = {"p0": sig.parse_engine(prefill.text()), "d0": sig.parse_engine(decode.text())}
    for _ in range(10):  # this interval: fast
        prefill.ttft.labels("m", "0").observe(0.02)
        decode.itl.labels("m", "0").observe(0.02)
    now_p, now_d = {"p0": sig.parse_engine(prefill.text())}, {"d0": sig.parse_engine(decode.text())}
    s = sig.signals(now_p, now_d, before, disaggregated=True)
    assert s.ttft_p90 is not None and s.ttft_p90 <= 0.05 and s.itl_p90 is not None and s.itl_p90 <= 0.05
    # The first reading of a pod has no interval: no latency yet.
    assert sig.signals(now_p, now_d, {}, disaggregated=True).ttft_p90 is None
    # A restarted engine (counters lower than before) counts from zero.
    restarted = Engine()
    restarted.ttft.labels("m", "0").observe(0.7)
    s = sig.signals({"p0": sig.parse_engine(restarted.text())}, now_d, {**before, "p0": now_p["p0"]}, True)
    assert s.ttft_p90 == pytest.approx(0.5 + 0.5 * 0.9)  # the one observation in (0.5, 1.0]
    # No new requests in the interval: latency 0.
    assert sig.signals(now_p, now_d, {**now_p, **now_d}, True).ttft_p90 == 0.0


def test_waiting_is_summed_over_prefill_pods_and_kv_averaged_over_decode_pods() -> None:
    readings = {}
    for pod, waiting, kv in (("p0", 2, 0.0), ("p1", 5, 0.0), ("d0", 0, 0.2), ("d1", 0, 0.6)):
        e = Engine()
        e.waiting.labels("m", "0").set(waiting)
        e.kv.labels("m", "0").set(kv)
        readings[pod] = sig.parse_engine(e.text())
    s = sig.signals({p: readings[p] for p in ("p0", "p1")}, {p: readings[p] for p in ("d0", "d1")}, {}, True)
    assert s.waiting == 7 and s.kv_usage == pytest.approx(0.4)


def test_promql_selects_the_monitors_labels() -> None:
    queries = sig.promql("prod", "qwen3-8b", disaggregated=True)
    assert queries["waiting"] == 'sum(vllm:num_requests_waiting{namespace="prod",model="qwen3-8b",pool="prefill",role="engine"})'
    assert 'pool="prefill"' in queries["ttft_p90"] and "vllm:time_to_first_token_seconds_bucket" in queries["ttft_p90"]
    assert 'pool="decode"' in queries["itl_p90"] and 'pool="decode"' in queries["kv_usage"]
    assert 'pool="decode"' in sig.promql("prod", "m", disaggregated=False)["ttft_p90"]


def test_query_results_nan_latency_is_idle_and_no_series_is_unknown() -> None:
    s = sig.from_query_results({"ttft_p90": [math.nan], "waiting": [3.0], "itl_p90": [], "kv_usage": [0.5]})
    assert s == Signals(ttft_p90=0.0, waiting=3.0, itl_p90=None, kv_usage=0.5)
