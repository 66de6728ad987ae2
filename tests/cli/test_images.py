"""The operator/sidecar image's Python dependencies (disagg_cli.images.build): the closure of
pyproject's dependencies, copied as the image build copies them, is all the sidecar needs, tracing
included (no image is built here: tests/e2e/test_cluster_tiny.py builds and runs both)."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

from disagg_cli.images.build import REPO, copy_distribution, light_dependencies
from tests.harness.otlp import otlp_receiver
from tests.sidecar.support import wait_for


def _dist(site: Path, name: str, files: list[str]) -> metadata.Distribution:
    info = site / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))
    for f in files:
        (site / f).parent.mkdir(parents=True, exist_ok=True)
        (site / f).write_text(f"# {name}\n")
    return metadata.PathDistribution(info)


def test_a_namespace_package_of_several_distributions_is_copied_once(tmp_path: Path) -> None:
    deps, site = tmp_path / "deps", tmp_path / "site"
    deps.mkdir()
    site.mkdir()
    api = _dist(deps, "ns_api", ["ns/api/__init__.py"])
    sdk = _dist(deps, "ns_sdk", ["ns/sdk/__init__.py"])
    for dist in (api, sdk):
        copy_distribution(dist, deps, site)
    assert (site / "ns/api/__init__.py").read_text() == "# ns_api\n"
    assert (site / "ns/sdk/__init__.py").read_text() == "# ns_sdk\n"


def test_the_images_dependencies_trace_a_request_on_their_own(tmp_path: Path) -> None:
    deps = Path(str(metadata.distribution("opentelemetry-sdk").locate_file("")))
    site = tmp_path / "site"
    site.mkdir()
    for dist in light_dependencies(deps):
        copy_distribution(dist, deps, site)
    script = """
import sys
from disagg_sidecar.config import SidecarConfig
from disagg_sidecar.tracing import Tracing
assert not any("site-packages" in p for p in sys.path), sys.path
config = SidecarConfig.model_validate({"decode": {"url": "http://127.0.0.1:8200"},
                                       "tracing": {"otlp_endpoint": sys.argv[1], "export_delay_seconds": 0.05}})
tracing = Tracing(config.tracing, "m")
with tracing.request("POST /v1/chat/completions", {}, {}):
    with tracing.leg("prefill", "http://127.0.0.1:9", "/inference/v1/generate", {}) as (span, headers):
        span.answered(200)
tracing.shutdown()
print(headers["traceparent"])
"""
    with otlp_receiver() as receiver:
        # -S: no site-packages of this interpreter; only the copied closure and the project's sources.
        out = subprocess.run([sys.executable, "-S", "-c", script, receiver.url], capture_output=True, text=True,
                             timeout=120, env={"PYTHONPATH": f"{site}:{REPO / 'sidecar'}", "PATH": "/usr/bin:/bin"})
        assert out.returncode == 0, out.stderr
        trace = out.stdout.split("-")[1]
        assert wait_for(lambda: len(receiver.trace(trace)) == 2, timeout=10), receiver.spans
    assert sorted(s.name for s in receiver.trace(trace)) == ["POST /v1/chat/completions", "prefill"]
