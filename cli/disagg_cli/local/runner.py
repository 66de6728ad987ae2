"""Local mode's process half: start the planned processes, record them, stop them by pid.

State lives in ``<state dir>/state.json`` (default ``.disagg/<name>/``): what ``disagg down`` and
``disagg status`` read. Every process runs in its own session, so stopping one stops its children
(vLLM's engine core) too.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from disagg_cli.local.plan import LOOPBACK, LocalProcess, engine_processes, sidecar_processes
from disagg_engine.servers import (
    ManagedServer, ServerSpec, free_port, pid_alive, signal_group, start, stop_all, wait_healthy,
)
from disagg_operator.plan import build_plan
from disagg_operator.spec import SpecError, parse_manifest

STATE_FILE = "state.json"
KV_DIR = "kv"  # ExampleConnector's shared directory, inside the state directory
HEALTH_TIMEOUT = 900.0


@dataclass(frozen=True)
class Deployment:
    name: str
    endpoint: str
    state_dir: str
    processes: list[dict[str, Any]]  # name, pool, url, pid, log

    def save(self) -> None:
        Path(self.state_dir, STATE_FILE).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, state_dir: Path) -> Deployment:
        return cls(**json.loads((state_dir / STATE_FILE).read_text()))


def load_spec(path: Path):
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise SpecError([f"{path}: not valid YAML: {exc}"]) from None
    if not isinstance(doc, dict):
        raise SpecError([f"{path}: expected one DisaggregatedModel object"])
    source = ((doc.get("spec") or {}).get("model") or {}).get("source")
    if isinstance(source, str) and source.startswith("~/"):
        # Local files may name weights under the home directory; the CRD needs absolute paths.
        doc["spec"]["model"]["source"] = str(Path(source).expanduser())
    return parse_manifest(doc)


def plan_processes(manifest, state_dir: Path, port: int | None) -> list[LocalProcess]:
    template = None
    spec = manifest.spec
    if spec.model.chat_template is not None:
        if spec.model.chat_template.inline is None:
            raise SpecError(["model.chatTemplate.configMapRef needs a cluster; use chatTemplate.inline locally"])
        template = state_dir / "chat-template.jinja"
        template.write_text(spec.model.chat_template.inline)
    plan = build_plan(spec, manifest.name, "local", **({"chat_template_path": str(template)} if template else {}))
    engines = engine_processes(plan, state_dir / KV_DIR, free_port)
    return engines + sidecar_processes(plan, engines, free_port, state_dir, first_port=port)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def up(path: Path, *, port: int | None = None, state_root: Path = Path(".disagg"),
       progress=lambda line: print(line, flush=True)) -> tuple[Deployment, list[ManagedServer]]:
    manifest = load_spec(path)
    state_dir = (state_root / manifest.name).resolve()
    if (state_dir / STATE_FILE).exists() and any(pid_alive(p["pid"]) for p in Deployment.load(state_dir).processes):
        raise SpecError([f"{manifest.name} is already up (state in {state_dir}); run `disagg down` first"])
    shutil.rmtree(state_dir, ignore_errors=True)
    (state_dir / KV_DIR).mkdir(parents=True)
    procs = plan_processes(manifest, state_dir, port)
    for proc in procs:
        if proc.config is not None:
            (state_dir / f"{proc.name}.yaml").write_text(yaml.safe_dump(dict(proc.config), sort_keys=False))
    progress(f"starting {len(procs)} processes for {manifest.name}: " + ", ".join(p.name for p in procs))
    servers = [start(ServerSpec(p.name, p.argv, p.port, env=p.env, host=LOOPBACK), state_dir / "logs") for p in procs]
    endpoint = next(p.url for p in procs if p.pool == "sidecar")
    deployment = Deployment(manifest.name, endpoint, str(state_dir), [
        {"name": s.spec.name, "pool": p.pool, "url": s.url, "pid": s.pid, "log": str(s.log_path)}
        for s, p in zip(servers, procs)
    ])
    deployment.save()
    try:
        wait_healthy(servers, HEALTH_TIMEOUT, progress=progress)
    except BaseException:
        stop_all(servers)
        shutil.rmtree(state_dir, ignore_errors=True)
        raise
    return deployment, servers


def down(state_dir: Path, grace: float = 15.0) -> list[str]:
    """Stop every recorded process group (TERM, then KILL after ``grace``); remove the state."""
    deployment = Deployment.load(state_dir)
    pids = [p["pid"] for p in deployment.processes]
    for pid in pids:
        signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in pids:
        signal_group(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    shutil.rmtree(state_dir, ignore_errors=True)
    return [p["name"] for p in deployment.processes]


def status(state_dir: Path) -> dict[str, Any]:
    deployment = Deployment.load(state_dir)
    pools: dict[str, list[dict[str, Any]]] = {}
    for p in deployment.processes:
        alive = pid_alive(p["pid"])
        pools.setdefault(p["pool"], []).append(
            {"name": p["name"], "url": p["url"], "pid": p["pid"], "healthy": alive and _healthy(p["url"])})
    return {"endpoint": deployment.endpoint, "pools": pools}


def find_state(state_root: Path, name: str | None) -> Path:
    if name:
        return (state_root / name).resolve()
    found = sorted(p.parent for p in state_root.glob(f"*/{STATE_FILE}"))
    if not found:
        raise SystemExit(f"disagg: nothing is up (no {state_root}/*/{STATE_FILE})")
    if len(found) > 1:
        raise SystemExit(f"disagg: several local deployments under {state_root}; name one with --name")
    return found[0]

