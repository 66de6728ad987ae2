"""The sidecar's /metrics with the decode engine's vLLM families (metrics.include_engine): the pure
merge of two expositions, then the scrape against a fake engine that is missing, slow or wrong."""

from __future__ import annotations

import time

import pytest
import requests
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from disagg_sidecar.upstream.exposition import engine_part, merge
from disagg_sidecar.metrics import Metrics
from tests.sidecar.support import fake_config, fake_engine, free_port, run_sidecar

ENGINE_ONLY = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
               "vllm:lora_requests_info", "vllm:request_success", "vllm:e2e_request_latency_seconds")


def engine_text(*extra: str) -> str:
    """An exposition as vLLM's server writes one: prometheus_client's default collectors (process,
    platform, gc) and vLLM's families, from prometheus_client itself; ``extra`` appended as is."""
    from prometheus_client import GCCollector, PlatformCollector, ProcessCollector

    r = CollectorRegistry()
    ProcessCollector(registry=r)
    PlatformCollector(registry=r)
    GCCollector(registry=r)
    Gauge("vllm:num_requests_waiting", "Waiting.", ["model_name"], registry=r).labels("tiny-qwen3").set(3)
    Gauge("vllm:num_requests_running", "Running.", ["model_name"], registry=r).labels("tiny-qwen3").set(2)
    Gauge("vllm:kv_cache_usage_perc", "KV cache usage.", ["model_name"], registry=r).labels("tiny-qwen3").set(0.25)
    Gauge("vllm:lora_requests_info", "LoRA.", ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
          registry=r).labels("4", "a,b", "").set(1.7e9)
    Counter("vllm:request_success", "Finished.", ["finished_reason"], registry=r).labels("stop").inc(7)
    Histogram("vllm:e2e_request_latency_seconds", "Latency.", registry=r).observe(0.3)
    return generate_latest(r).decode() + "".join(extra)


def families(text: str) -> dict[str, object]:
    """Family name -> family, by prometheus_client's own parser; a name twice fails the test."""
    parsed = list(text_string_to_metric_families(text))
    names = [f.name for f in parsed]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    return {f.name: f for f in parsed}


def own_text() -> str:
    metrics = Metrics()
    metrics.requests.labels("chat", "200").inc()
    return metrics.render().decode()


def test_engine_families_follow_the_sidecars_own_with_help_type_and_samples() -> None:
    own, engine = own_text(), engine_text()
    merged = merge(own, engine)
    assert merged == own + engine_part(own, engine)
    got, theirs, ours = families(merged), families(engine), families(own)
    for name in ENGINE_ONLY:
        assert (got[name].samples, got[name].documentation, got[name].type) == (
            theirs[name].samples, theirs[name].documentation, theirs[name].type)
    assert "# TYPE vllm:num_requests_waiting gauge" in merged
    assert "# HELP vllm:request_success_total Finished." in merged
    # Both export process_* and python_*: the sidecar's stay (they describe the process serving the port).
    shared = set(ours) & set(theirs)
    assert {"process_start_time_seconds", "python_info", "python_gc_collections"} <= shared
    for name in shared:
        assert got[name].samples == ours[name].samples
    assert set(got) == set(ours) | set(theirs)


def test_a_colliding_engine_family_is_dropped_by_family_or_sample_name() -> None:
    own = own_text()
    engine = engine_text(
        "# HELP disagg_sidecar_requests_total Not ours.\n# TYPE disagg_sidecar_requests_total counter\n"
        'disagg_sidecar_requests_total{api="chat",code="500"} 99.0\n',
        "# HELP process_cpu_seconds_total A gauge with a counter's sample name.\n"
        "# TYPE process_cpu_seconds_total gauge\nprocess_cpu_seconds_total 12345.0\n")
    got = families(merge(own, engine))
    assert got["disagg_sidecar_requests"].samples == families(own)["disagg_sidecar_requests"].samples
    assert all(s.value != 99.0 for s in got["disagg_sidecar_requests"].samples)
    assert "process_cpu_seconds_total" not in got and got["process_cpu_seconds"].type == "counter"
    assert "vllm:num_requests_waiting" in got


def test_an_engine_name_written_twice_keeps_the_first() -> None:
    # A counter declared without _total, then its _total sample: the parser yields two families
    # that would both be written as b_total.
    merged = merge(own_text(), "# HELP b Two.\n# TYPE b counter\nb_total 2.0\n")
    assert merged.count("# TYPE b_total") == 1
    families(merged)


@pytest.mark.parametrize("garbage", ["<html><body>404 Not Found</body></html>", '{"error": "nope"}',
                                     "vllm:num_requests_waiting three\n", "# TYPE x gauge\nx{a=\"1\" 2\n"])
def test_garbage_engine_text_is_refused(garbage: str) -> None:
    with pytest.raises(ValueError, match="not a Prometheus text exposition"):
        merge(own_text(), garbage)


def test_an_empty_engine_text_adds_nothing() -> None:
    own = own_text()
    assert merge(own, "") == own


# -- the scrape, against a fake decode engine ---------------------------------------------------------

def scrape(url: str) -> tuple[str, float]:
    started = time.monotonic()
    r = requests.get(url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
    return r.text, time.monotonic() - started


def missing(text: str) -> dict[str, float]:
    [family] = [f for f in text_string_to_metric_families(text) if f.name == "disagg_sidecar_engine_metrics_missing"]
    return {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")}


def test_include_engine_serves_the_engines_families_at_the_sidecars_port() -> None:
    with fake_engine() as engine:
        engine.metrics = engine_text()
        with run_sidecar(fake_config(engine, metrics={"include_engine": True})) as sidecar:
            text, _ = scrape(sidecar.url)
    got = families(text)
    assert got["vllm:num_requests_waiting"].samples[0].value == 3
    assert got["vllm:kv_cache_usage_perc"].samples[0].value == 0.25
    assert "disagg_sidecar_requests" in got and missing(text) == {}
    [call] = [c for c in engine.calls if c.path == "/metrics"]
    assert call.headers["Accept-Encoding"] == "identity"  # the upstream session does not decompress


def test_the_engines_families_are_reused_for_max_age_then_fetched_again() -> None:
    with fake_engine() as engine:
        engine.metrics = engine_text()
        config = fake_config(engine, metrics={"include_engine": True, "engine_max_age_seconds": 10})
        with run_sidecar(config) as sidecar:
            first, _ = scrape(sidecar.url)
            engine.metrics = engine.metrics.replace("vllm:num_requests_waiting{model_name=\"tiny-qwen3\"} 3.0",
                                                    "vllm:num_requests_waiting{model_name=\"tiny-qwen3\"} 9.0")
            second, _ = scrape(sidecar.url)
        assert len([c for c in engine.calls if c.path == "/metrics"]) == 1
        assert families(second)["vllm:num_requests_waiting"].samples[0].value == 3
        with run_sidecar({**config, "metrics": {"include_engine": True, "engine_max_age_seconds": 0}}) as sidecar:
            fresh, _ = scrape(sidecar.url)
    assert families(fresh)["vllm:num_requests_waiting"].samples[0].value == 9
    assert families(first)["vllm:num_requests_waiting"].samples[0].value == 3


def test_without_include_engine_the_engine_is_not_asked() -> None:
    with fake_engine() as engine:
        engine.metrics = engine_text()
        with run_sidecar(fake_config(engine)) as sidecar:
            text, _ = scrape(sidecar.url)
    assert "vllm:num_requests_waiting" not in families(text)
    assert all(c.path != "/metrics" for c in engine.calls)


@pytest.mark.parametrize("fault, reason", [("garbage", "invalid"), ("500", "status"), ("404", "status"),
                                           ("slow", "timeout"), ("gone", "unreachable")])
def test_a_missing_engine_exposition_serves_the_sidecars_own_and_counts_it(fault: str, reason: str) -> None:
    with fake_engine() as engine:
        engine.metrics = "<html>oops</html>" if fault == "garbage" else engine_text()
        if fault == "500":
            engine.answer["/metrics"] = (500, b"{}")
        if fault == "404":
            engine.metrics = None
        if fault == "slow":
            engine.delay["/metrics"] = 5.0
        decode = {"url": f"http://127.0.0.1:{free_port()}"} if fault == "gone" else {"url": engine.url}
        config = fake_config(engine, decode=decode, metrics={"include_engine": True, "engine_timeout_seconds": 0.3,
                                                             "engine_max_age_seconds": 10})  # a miss is never reused
        with run_sidecar(config) as sidecar:
            first, seconds = scrape(sidecar.url)
            second, _ = scrape(sidecar.url)
    got = families(first)
    assert "disagg_sidecar_requests" in got and not any(name.startswith("vllm:") for name in got)
    assert seconds < 2.5  # the engine's 5 s never reach the scraper
    assert missing(first) == {reason: 1.0} and missing(second) == {reason: 2.0}
