"""The pods of a label selector over a stretch of a test: each pod's labels and IP as it appears,
and optionally one container's log for the pod's whole life in that stretch, for tests that check
what pods did while a rollout replaced them (tests/e2e/test_cluster_tiny.py).

A background thread lists the pods through the API (in-process, ``Cluster.api``) every
``interval`` seconds. For each pod whose container has started it runs ``kubectl logs -f
--since-time=<start>`` into a file until the container exits; a stream that ends while the container
still runs is started again (from the same start: nothing is lost, lines repeat). A pod's log is
``whole`` once a follower ended after its container did (or the pod was gone), or, for a pod still
running when the watch stops, once a last ``kubectl logs`` (no ``-f``) read it.
"""
from __future__ import annotations

import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from tests.harness.cluster import Cluster, ClusterError


@dataclass
class Seen:
    """One pod as the watch saw it: its labels and IP (the first the API reported) and its log files."""
    name: str
    labels: dict[str, str]
    ip: str | None = None
    logs: list[Path] = field(default_factory=list)
    follower: subprocess.Popen | None = None
    ended_once: bool = False  # a follower's stream ended without an error
    whole: bool = False

    def lines(self) -> list[str]:
        """The container's log lines, each once (followers started again repeat the earlier ones)."""
        seen: dict[str, None] = {}
        for path in self.logs:
            seen.update(dict.fromkeys(path.read_text(errors="replace").splitlines()))
        return list(seen)


def _container_state(pod: dict[str, Any], container: str) -> str | None:
    """running, terminated, waiting, or None before the kubelet reported it."""
    for status in pod.get("status", {}).get("containerStatuses") or ():
        if status["name"] == container:
            return next(iter(status.get("state") or {}), None)
    return None


@dataclass
class PodWatch:
    cluster: Cluster
    ns: str
    selector: str
    out_dir: Path
    container: str | None = None  # None: no logs, only labels and IPs
    interval: float = 0.5
    pods: dict[str, Seen] = field(default_factory=dict)  # by pod name
    errors: list[str] = field(default_factory=list)  # API answers that failed (the next poll retries)
    since: str = ""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __enter__(self) -> PodWatch:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 1))
        self.poll()  # the pods there at the start are known when the block begins
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def snapshot(self) -> dict[str, Seen]:
        with self._lock:
            return dict(self.pods)

    def stop(self) -> None:
        """Stop polling; each pod still running has its log read once more, whole up to now."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)
            assert not self._thread.is_alive(), "the pod watch did not stop"
        if self.container is None:
            return
        listed = {p["metadata"]["name"]: p for p in self._list()}
        for seen in self.pods.values():
            if seen.follower is not None and seen.follower.poll() is None:
                seen.follower.terminate()
                seen.follower.wait(30)
            if not seen.whole and seen.name in listed:
                path = self._log_path(seen)
                with path.open("wb") as out:
                    done = subprocess.run(self._kubectl_logs(seen.name, follow=False), stdout=out,
                                          stderr=subprocess.PIPE, timeout=120)
                seen.logs.append(path)
                seen.whole = done.returncode == 0
                if not seen.whole:
                    self.errors.append(f"{seen.name}: {done.stderr.decode(errors='replace')[-500:]}")

    # -- the polling thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def _list(self) -> list[dict[str, Any]]:
        path = f"/api/v1/namespaces/{self.ns}/pods?labelSelector={quote(self.selector)}"
        return self.cluster.api("GET", path)["items"]

    def poll(self) -> None:
        try:
            listed = {p["metadata"]["name"]: p for p in self._list()}
        except (ClusterError, OSError) as exc:  # requests' errors are OSErrors
            self.errors.append(str(exc)[:300])
            return
        with self._lock:
            for name, pod in listed.items():
                seen = self.pods.setdefault(name, Seen(name, dict(pod["metadata"].get("labels") or {})))
                seen.ip = seen.ip or pod.get("status", {}).get("podIP")
            if self.container is not None:
                for seen in self.pods.values():
                    self._follow(seen, listed.get(seen.name))

    def _follow(self, seen: Seen, pod: dict[str, Any] | None) -> None:
        """Keep one follower on the pod's container while it runs; mark the log whole after."""
        assert self.container is not None
        if seen.whole or (seen.follower is not None and seen.follower.poll() is None):
            return
        state = _container_state(pod, self.container) if pod is not None else None
        if seen.follower is not None and seen.follower.returncode == 0:
            seen.ended_once = True
        if pod is None or state == "terminated":
            # A stream ends when the container does: once one ended so, it read to the end (a
            # follower started again after that, while the pod still said running, may find the
            # pod deleted). Gone without one: never whole.
            seen.whole = seen.ended_once
            if seen.whole or pod is None:
                return
        if state in ("running", "terminated"):
            path = self._log_path(seen)
            with path.open("wb") as out:
                seen.follower = subprocess.Popen(self._kubectl_logs(seen.name, follow=True), stdout=out,
                                                 stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
            seen.logs.append(path)

    def _log_path(self, seen: Seen) -> Path:
        return self.out_dir / f"{seen.name}.{len(seen.logs)}.log"

    def _kubectl_logs(self, pod: str, follow: bool) -> list[str]:
        assert self.container is not None
        return [str(self.cluster.bin_dir / "kubectl"), f"--kubeconfig={self.cluster.kubeconfig}", "logs", pod,
                "-n", self.ns, "-c", self.container, f"--since-time={self.since}", *(["-f"] if follow else [])]
