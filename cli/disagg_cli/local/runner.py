"""Local mode's process half: start the planned processes, record them, stop them by pid.

State lives in ``<state dir>/state.json`` (default ``.disagg/<name>/``): what ``disagg down``,
``disagg status`` and the supervisor (supervise.py) read; each process's command is recorded so it
can be started again on its port. Every process runs in its own session, so stopping one stops its
children (vLLM's engine core) too. Logs (``<state dir>/logs/``) outlive a failed start and a
deployment in which a process crashed: the error says where they are and shows their last errors.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from disagg_cli.local.plan import ENGINE_KEY_FILE, LOOPBACK, LocalProcess, engine_processes, sidecar_processes
from disagg_cli.local.supervise import Member, error_lines
from disagg_engine.servers import (
    ManagedServer, ServerSpec, ServerStartError, free_port, pid_alive, signal_group, start, stop_all, wait_healthy,
)
from disagg_operator.objects.secrets import new_key
from disagg_operator.plan import build_plan
from disagg_operator.manifest import parse_manifest
from disagg_operator.spec import SpecError
from disagg_sidecar.config import dump_config

STATE_FILE = "state.json"
KV_DIR = "kv"  # ExampleConnector's shared directory, inside the state directory
LOG_DIR = "logs"
HEALTH_TIMEOUT = 900.0


@dataclass(frozen=True)
class Deployment:
    name: str
    endpoint: str
    state_dir: str
    processes: list[dict[str, Any]]  # name, pool, url, pid, log, argv, env, port, restarts, failed
    supervisor_pid: int | None = None  # `disagg supervise` of a detached deployment

    def save(self) -> None:
        """Atomically: the supervisor rewrites it while `disagg status` or `down` may read it."""
        tmp = Path(self.state_dir, STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        os.replace(tmp, Path(self.state_dir, STATE_FILE))

    def members(self, servers: list[ManagedServer] | None = None) -> list[Member]:
        """The processes to supervise: ``servers`` when this process started them, else adopted by pid."""
        ours = {s.spec.name: s for s in servers or []}
        return [Member(p["name"], ServerSpec(p["name"], p["argv"], p["port"], env=p["env"], host=LOOPBACK), p["pid"],
                       Path(p["log"]), ours[p["name"]].proc if p["name"] in ours else None)
                for p in self.processes]

    def record(self, members: list[Member]) -> None:
        """New pids, restart counts and spent budgets, as the supervisor sees them."""
        by_name = {m.name: m for m in members}
        for p in self.processes:
            m = by_name[p["name"]]
            p.update(pid=m.pid, restarts=len(m.restarts), failed=m.failed)
        self.save()

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
    # The local engines have the disagg package: they load a connector's own engine class.
    plan = build_plan(spec, manifest.name, "local", kv_shared_path=str(state_dir / KV_DIR), engine_package=True,
                      **({"chat_template_path": str(template)} if template else {}))
    engines = engine_processes(plan, free_port, _engine_key(state_dir) if spec.security.engine_api_key.enabled else None)
    return engines + sidecar_processes(plan, engines, free_port, state_dir, first_port=port)


def _engine_key(state_dir: Path) -> str:
    """A new random engine key in ``state_dir`` (mode 0600; the directory is 0700)."""
    key = new_key()
    fd = os.open(state_dir / ENGINE_KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


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
    state_dir.chmod(0o700)  # the engine key, and the state file holding the engines' environment
    procs = plan_processes(manifest, state_dir, port)
    for proc in procs:
        if proc.config is not None:
            (state_dir / f"{proc.name}.yaml").write_text(yaml.safe_dump(dump_config(proc.config), sort_keys=False))
    progress(f"starting {len(procs)} processes for {manifest.name}: " + ", ".join(p.name for p in procs))
    servers = [start(ServerSpec(p.name, p.argv, p.port, env=p.env, host=LOOPBACK), state_dir / LOG_DIR)
               for p in procs]
    endpoint = next(p.url for p in procs if p.pool == "sidecar")
    deployment = Deployment(manifest.name, endpoint, str(state_dir), [
        {"name": s.spec.name, "pool": p.pool, "url": s.url, "pid": s.pid, "log": str(s.log_path),
         "argv": list(p.argv), "env": dict(p.env), "port": p.port, "restarts": 0, "failed": False}
        for s, p in zip(servers, procs)
    ])
    deployment.save()
    try:
        wait_healthy(servers, HEALTH_TIMEOUT, progress=progress)
    except ServerStartError as exc:
        stop_all(servers)
        _keep_logs_only(state_dir)
        dead = next((s for s in servers if s.proc.returncode not in (None, -15, -9)), None)
        detail = f"{dead.spec.name}'s last errors:\n    " + "\n    ".join(error_lines(dead.log_path)) if dead else ""
        raise ServerStartError(f"{str(exc).splitlines()[0]}\nlogs kept in {state_dir / LOG_DIR}\n{detail}") from None
    except BaseException:
        stop_all(servers)
        _keep_logs_only(state_dir)
        raise
    return deployment, servers


def _keep_logs_only(state_dir: Path) -> None:
    """Remove the state (so `disagg up` can run again) and the KV files; keep the logs."""
    for path in state_dir.iterdir():
        if path.name != LOG_DIR:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def down(state_dir: Path, grace: float = 15.0) -> tuple[list[str], Path | None]:
    """Stop the supervisor, then every recorded process group (TERM, then KILL after ``grace``);
    remove the state. Returns the names stopped and where logs were kept (when a process had
    crashed), else None."""
    supervisor = Deployment.load(state_dir).supervisor_pid
    if supervisor is not None:
        _stop_pids([supervisor], grace)
    deployment = Deployment.load(state_dir)  # after the supervisor's last restart
    crashed = any(p.get("restarts") or p.get("failed") or not pid_alive(p["pid"]) for p in deployment.processes)
    _stop_pids([p["pid"] for p in deployment.processes], grace)
    if crashed:
        _keep_logs_only(state_dir)
        return [p["name"] for p in deployment.processes], state_dir / LOG_DIR
    shutil.rmtree(state_dir, ignore_errors=True)
    return [p["name"] for p in deployment.processes], None


def _stop_pids(pids: list[int], grace: float) -> None:
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


def status(state_dir: Path) -> dict[str, Any]:
    deployment = Deployment.load(state_dir)
    pools: dict[str, list[dict[str, Any]]] = {}
    for p in deployment.processes:
        alive = pid_alive(p["pid"])
        pools.setdefault(p["pool"], []).append(
            {"name": p["name"], "url": p["url"], "pid": p["pid"], "healthy": alive and _healthy(p["url"]),
             "restarts": p.get("restarts", 0)})
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

