"""``disagg up`` of a deployment whose engines cannot start: exit 1, the logs kept and named, and
the failed process's last error lines printed (its processes really start and really fail: a
``PYTHONHOME`` that does not exist stops each engine's Python at start-up)."""

from __future__ import annotations

from pathlib import Path

import yaml

from disagg_cli.local.runner import STATE_FILE
from tests.harness.engine import disagg

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "local-tiny.yaml"


def test_a_failed_start_keeps_the_logs_and_prints_the_last_errors(tmp_path):
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["model"]["env"] = [{"name": "PYTHONHOME", "value": str(tmp_path / "nowhere")}]
    spec = tmp_path / "broken.yaml"
    spec.write_text(yaml.safe_dump(doc))
    out = disagg("up", str(spec), "--state-dir", str(tmp_path / "state"), timeout=120)
    logs = tmp_path / "state" / "local-tiny" / "logs"
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"logs kept in {logs}" in out.stderr
    assert "last errors:" in out.stderr and "Fatal Python error" in out.stderr, out.stderr
    assert {p.name for p in logs.iterdir()} >= {"prefill-0.log", "decode-0.log", "render-0.log"}
    assert not (tmp_path / "state" / "local-tiny" / STATE_FILE).exists()  # `disagg up` may run again
