"""A py-spy profile of a running process while a load runs, summarised by function."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any


def py_spy() -> str | None:
    """py-spy from PATH or beside the bench extra (benchmarks/setup)."""
    if found := shutil.which("py-spy"):
        return found
    for entry in sys.path:
        candidate = Path(entry) / "bin" / "py-spy"
        if candidate.is_file():
            return str(candidate)
    return None


def collapsed_top(lines: list[str], top: int = 15) -> dict[str, list[tuple[str, float]]]:
    """Shares of samples per function from py-spy's collapsed stacks (``a;b;c COUNT``): ``self``
    (the leaf frame) and ``total`` (anywhere on the stack)."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    samples = 0
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        samples += n
        own[frames[-1]] += n
        for frame in set(frames):
            total[frame] += n
    if not samples:
        return {"self": [], "total": []}
    return {k: [(f, round(100 * n / samples, 1)) for f, n in c.most_common(top)] for k, c in (("self", own), ("total", total))}


def profile(pid: int, load: Callable[[float], Any], out: Path, seconds: int = 20, rate: int = 250) -> dict[str, Any]:
    """Record ``pid`` for ``seconds`` while ``load(deadline)`` (a ``time.monotonic()`` value) runs in
    this process; collapsed stacks to ``out``."""
    exe = py_spy()
    if exe is None:
        return {"error": "py-spy not installed (benchmarks/setup installs it)"}
    rec = subprocess.Popen([exe, "record", "--pid", str(pid), "--rate", str(rate), "--duration", str(seconds),
                            "--gil", "--format", "raw", "--output", str(out), "--nonblocking"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    worker = threading.Thread(target=load, args=(time.monotonic() + seconds,), daemon=True)
    worker.start()
    log, _ = rec.communicate(timeout=seconds + 120)
    worker.join(timeout=600)
    if rec.returncode != 0 or not out.exists():
        return {"error": f"py-spy exited {rec.returncode}: {log[-500:]}"}
    return {"file": out.name, **collapsed_top(out.read_text().splitlines())}
