"""`disagg crd`, `disagg manifests` and `disagg scrape-config` through the real console-script dispatcher."""

from __future__ import annotations

import base64
import io
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from disagg_cli.main import main
from disagg_operator.objects import build_objects
from disagg_operator.objects.monitors import pod_monitors
from disagg_operator.plan import build_plan
from disagg_operator.manifest import parse_manifest
from disagg_operator.scrape_configs import scrape_configs

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "qwen3-8b.yaml"


def test_disagg_crd_prints_the_checked_in_crd(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crd"]) == 0
    assert capsys.readouterr().out == (REPO / "crds" / "disagg.dev_disaggregatedmodels.yaml").read_text()


def test_disagg_manifests_prints_the_operator_objects(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["manifests", str(EXAMPLE), "--namespace", "serving"]) == 0
    printed = list(yaml.safe_load_all(capsys.readouterr().out))
    manifest = parse_manifest(yaml.safe_load(EXAMPLE.read_text()), "serving")
    # The engine API key Secret carries a fresh random key (the operator adds it on creation).
    [secret] = [o for o in printed if o["kind"] == "Secret"]
    key = base64.b64decode(secret.pop("data")["api-key"])
    assert len(key) >= 43 and key != base64.b64decode(_printed_secret_key())
    # PodMonitors (monitoring.podMonitors auto) only where the CRD is served, which a manifest cannot know.
    assert printed == [o for o in build_objects(build_plan(manifest.spec, manifest.name, manifest.namespace))
                       if o["kind"] != "PodMonitor"]
    assert {o["metadata"]["namespace"] for o in printed} == {"serving"}


def test_disagg_manifests_prints_pod_monitors_when_asked_for(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    for setting, count in (("true", 2), ("auto", 0), ("false", 0)):
        doc["spec"]["monitoring"] = {"podMonitors": setting}
        (tmp_path / "m.yaml").write_text(yaml.safe_dump(doc))
        assert main(["manifests", str(tmp_path / "m.yaml")]) == 0
        printed = list(yaml.safe_load_all(capsys.readouterr().out))
        assert sum(o["kind"] == "PodMonitor" for o in printed) == count, setting


def _printed_secret_key() -> str:
    out = subprocess.run([sys.executable, "-m", "disagg_cli.main", "manifests", str(EXAMPLE)], check=True,
                         capture_output=True, text=True).stdout
    return next(o for o in yaml.safe_load_all(out) if o["kind"] == "Secret")["data"]["api-key"]


def test_disagg_manifests_reads_a_stream_from_stdin(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    docs = [yaml.safe_load(EXAMPLE.read_text()), yaml.safe_load((REPO / "examples" / "minimal.yaml").read_text())]
    docs[1]["metadata"]["namespace"] = "other"
    monkeypatch.setattr(sys, "stdin", io.StringIO(yaml.safe_dump_all(docs)))
    assert main(["manifests", "-"]) == 0
    printed = list(yaml.safe_load_all(capsys.readouterr().out))
    instances = {(o["metadata"]["labels"]["app.kubernetes.io/instance"], o["metadata"]["namespace"]) for o in printed}
    assert instances == {("qwen3-8b", "default"), ("qwen3-0-6b", "other")}


def test_disagg_manifests_rejects_an_invalid_model_with_its_message(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["pools"]["decode"]["replicas"] = 0
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["manifests", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "spec.pools.decode.replicas: pools.decode.replicas must be at least 1" in captured.err


@pytest.mark.parametrize(("content", "message"), [
    ("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n", "document 1 is a ConfigMap, not a disagg.dev/v1alpha1"),
    ("a: [\n", "cannot read"),
])
def test_disagg_manifests_explains_unusable_input(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  content: str, message: str) -> None:
    path = tmp_path / "in.yaml"
    path.write_text(content)
    assert main(["manifests", str(path)]) == 1
    assert message in capsys.readouterr().err


def test_missing_file_is_an_error_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["manifests", "/nonexistent/model.yaml"]) == 1
    assert "cannot read /nonexistent/model.yaml" in capsys.readouterr().err


def test_disagg_scrape_config_prints_the_jobs_of_a_models_monitors(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    tiny = REPO / "examples" / "cluster-tiny.yaml"  # three claims beside the model: they have no monitors
    assert main(["scrape-config", str(tiny), "-n", "serving", "--kubeconfig-file", "/k/config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    [doc] = [d for d in yaml.safe_load_all(tiny.read_text()) if d["kind"] == "DisaggregatedModel"]
    manifest = parse_manifest(doc, "serving")
    monitors = pod_monitors(build_plan(manifest.spec, manifest.name, manifest.namespace))  # written also on auto
    assert printed == {"scrape_configs": scrape_configs(monitors, kubeconfig_file="/k/config")}
    assert [j["job_name"] for j in printed["scrape_configs"]] == [
        "podMonitor/serving/cluster-tiny-engines/0", "podMonitor/serving/cluster-tiny-sidecars/0"]
    # The same monitors as the API server lists them (`kubectl get podmonitors -o yaml`) print the same.
    listed = {"apiVersion": "v1", "kind": "List", "items": [
        {**m, "metadata": {**m["metadata"], "uid": "u", "resourceVersion": "7"}} for m in monitors]}
    monkeypatch.setattr(sys, "stdin", io.StringIO(yaml.safe_dump(listed)))
    assert main(["scrape-config", "-", "--kubeconfig-file", "/k/config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == printed


@pytest.mark.parametrize(("content", "message"), [
    ("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n", "no DisaggregatedModel and no PodMonitor in"),
    ("a: [\n", "cannot read"),
    (yaml.safe_dump({**yaml.safe_load((REPO / "examples" / "minimal.yaml").read_text()),
                     "spec": {"model": {"source": "hf://Qwen/Qwen3-0.6B"}, "monitoring": {"podMonitors": "false"}}}),
     "podMonitors is false"),
    ("apiVersion: monitoring.coreos.com/v1\nkind: PodMonitor\nmetadata: {name: x}\n"
     "spec: {selector: {}, podMetricsEndpoints: [{port: p, bearerTokenSecret: {}}]}\n", "bearerTokenSecret"),
])
def test_disagg_scrape_config_explains_unusable_input(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      content: str, message: str) -> None:
    path = tmp_path / "in.yaml"
    path.write_text(content)
    assert main(["scrape-config", str(path)]) == 1
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


def test_pure_modules_import_neither_vllm_torch_nor_kubernetes_clients() -> None:
    code = (
        "import sys, disagg_operator, disagg_operator.commands, disagg_operator.crd, disagg_operator.plan, "
        "disagg_operator.objects, disagg_operator.status\n"
        "from disagg_operator.commands import render_manifests\n"
        "heavy = sorted(m for m in ('vllm', 'torch', 'kopf', 'kubernetes', 'aiohttp') if m in sys.modules)\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_disagg_operator_help_names_its_namespace_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["operator", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--namespace NS" in out and "all namespaces" in out


@pytest.fixture
def kopf_runs(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, object]]:
    """`disagg operator` up to kopf.run: the keyword arguments of every kopf.run call (nothing runs)."""
    import kopf

    calls: list[dict[str, object]] = []
    monkeypatch.setattr(kopf, "run", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(kopf, "configure", lambda **kwargs: None)
    return calls


def test_disagg_operator_is_standalone_without_peering(kopf_runs: list[dict[str, object]]) -> None:
    assert main(["operator", "-n", "team-a"]) == 0
    (run,) = kopf_runs
    assert run["standalone"] is True and run["peering_name"] is None and run["priority"] is None
    assert run["clusterwide"] is False and run["namespaces"] == ["team-a"]


def test_peering_replicas_draw_their_own_random_priorities(kopf_runs: list[dict[str, object]]) -> None:
    # kopf pauses every replica when the top priority is shared: replicas must never tie.
    for _ in range(20):
        assert main(["operator", "--peering", "disagg"]) == 0
    assert all(run["standalone"] is False and run["peering_name"] == "disagg" and run["clusterwide"] is True
               for run in kopf_runs)
    priorities = [run["priority"] for run in kopf_runs]
    assert all(isinstance(p, int) and 0 <= p < 2**31 for p in priorities), priorities
    assert len(set(priorities)) == len(priorities)


def test_peering_priority_can_be_given(kopf_runs: list[dict[str, object]]) -> None:
    assert main(["operator", "--peering", "disagg", "--priority", "100", "-n", "team-a"]) == 0
    (run,) = kopf_runs
    assert run["priority"] == 100 and run["peering_name"] == "disagg" and run["namespaces"] == ["team-a"]


def test_priority_without_peering_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["operator", "--priority", "5"])
    assert exit_.value.code == 2
    assert "--priority needs --peering" in capsys.readouterr().err
