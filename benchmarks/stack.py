"""The system under test: the harness's real vLLM CPU servers (started here, or attached with
``DISAGG_ATTACH_SERVERS``), ``disagg sidecar`` processes in front of them, and what passes
between a sidecar and its render/derender tier (the tests' recording pass-through)."""

from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from disagg_engine.servers import ServerSpec, free_port, start_all
from disagg_engine.testing.server_set import ENGINE_ENV, ROLE_ENV, ROLES, ServerSet, role_argv
from disagg_engine.testing.tiny_model import ensure_model
from tests.harness.engine import _attached_set
from tests.sidecar.support import Recorded, SidecarProcess, recording_proxy, sidecar_config, sidecar_process

__all__ = ["recording_proxy", "server_set", "sidecar", "sidecar_config", "traffic"]


# The harness's 8,192 leaves no room for an 8,192-token answer after its prompt.
MAX_MODEL_LEN = 9216


def max_output_tokens(sset: ServerSet) -> int:
    """The longest answer the set's servers allow after a short prompt (an attached harness set: 8,192 in all)."""
    return (MAX_MODEL_LEN if getattr(sset, "bench_owned", False) else 8192) - 512


@contextmanager
def server_set(log_dir: Path) -> Iterator[ServerSet]:
    """The four servers (render, prefill, decode with the extension, coupled = stock vLLM):
    ``disagg_engine.testing.server_set``'s flags with a longer context, or attached ones."""
    if attach := os.environ.get("DISAGG_ATTACH_SERVERS"):
        yield _attached_set(attach)
        return
    log_dir.mkdir(parents=True, exist_ok=True)
    model = ensure_model()
    kv_dir = Path(tempfile.mkdtemp(prefix="disagg-kv-"))
    extra = ["--max-model-len", str(MAX_MODEL_LEN)]
    # The tiny model's config says 8,192 positions; its RoPE has no learned limit beyond that.
    env = {**ENGINE_ENV, "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    specs = [ServerSpec(name=role, argv=role_argv(role, model, port, kv_dir, extra), port=port,
                        env={**env, **ROLE_ENV.get(role, {})}) for role in ROLES for port in [free_port()]]
    servers = start_all(specs, log_dir, timeout=1800)
    sset = ServerSet({s.spec.name: s for s in servers}, model, kv_dir, log_dir)
    sset.bench_owned = True  # type: ignore[attr-defined]
    try:
        yield sset
    finally:
        sset.stop()


@contextmanager
def sidecar(config: dict[str, Any]) -> Iterator[SidecarProcess]:
    """``disagg sidecar --config FILE`` as its own process (its CPU is measured by pid)."""
    with tempfile.TemporaryDirectory(prefix="bench-sidecar-") as tmp:
        with sidecar_process(config, Path(tmp)) as proc:
            yield proc


def traffic(calls: list[Recorded]) -> dict[str, dict[str, int]]:
    """Calls and bytes by path through a ``recording_proxy``: ``bytes_out`` sidecar -> tier
    (request bodies, by their Content-Length), ``bytes_in`` tier -> sidecar (response bodies)."""
    out: dict[str, dict[str, int]] = {"calls": defaultdict(int), "bytes_out": defaultdict(int), "bytes_in": defaultdict(int)}
    for call in calls:
        length = next((v for k, v in call.headers.items() if k.lower() == "content-length"), None)
        out["calls"][call.path] += 1
        out["bytes_out"][call.path] += int(length) if length is not None else len(json.dumps(call.body).encode())
        out["bytes_in"][call.path] += len(call.response)
    return {k: dict(v) for k, v in out.items()}
