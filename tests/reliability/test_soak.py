"""Soak (`make bench BENCH=soak` runs the full 60 s): 200 concurrent chat streams through
one ``disagg sidecar`` process in front of the real servers (render, remote prefill, decode). No
errors, memory flat after the first seconds, and once the load stops no client connection, request
or thread left behind. Shorter than the benchmark's and with looser bounds: it runs in `make test`."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.outputs import plain_ids, short_chat
from benchmarks.soak import soak
from tests.sidecar.support import sidecar_config, sidecar_process

pytestmark = [pytest.mark.engine, pytest.mark.reliability]

STREAMS, SECONDS, EARLY = 200, 15.0, 5.0
RSS_GROWTH = 0.25  # the benchmark's goal is 10% between 10 s and 60 s


def test_two_hundred_streams_without_errors_or_leaks(engine_set, forcer, tmp_path: Path, record_property) -> None:
    ids = plain_ids(16, forcer.tokenizer)
    with sidecar_process(sidecar_config(engine_set), tmp_path) as side:
        res = soak(side.url, side.proc.pid, lambda i: short_chat(ids, True, i), STREAMS, SECONDS, EARLY,
                   settle_timeout=30)
    for key in ("requests", "errors", "load_seconds", "settle_seconds"):
        record_property(f"soak_{key}", getattr(res, key))
    record_property("soak_rss_mb", res.rss_mb)
    print(f"soak: {res.requests} streams in {res.load_seconds:.1f}s, back to base {res.settle_seconds:.1f}s later")
    assert res.requests >= STREAMS, f"only {res.requests} streams finished in {SECONDS}s"
    assert res.errors == 0, res.error_samples
    assert res.rss_growth_ratio <= RSS_GROWTH, res.rss_mb
    assert res.settle_seconds == res.settle_seconds, f"not back to base: before {res.base}, after {res.after}"
