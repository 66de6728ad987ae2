"""The render processes that run the engine extension's derender sessions, as the session tests
see them (``session_renders``, tests/harness/engine.py): one the harness starts in its background
thread, which a test kills mid-stream, and the demo's render (the shared set's, with the
extension too); ``DISAGG_ATTACH_SESSION_RENDERS=<json file: a list of {url, pid}>`` attaches to a
killable one already running."""

from __future__ import annotations

import requests


class Render:
    def __init__(self, url: str, pid: int):
        self.url, self.pid = url, pid

    def capabilities(self) -> dict:
        return requests.get(self.url + "/disagg/v1/capabilities", timeout=10).json()

    def live_sessions(self) -> int:
        return self.capabilities()["live_derender_sessions"]

    def alive(self) -> bool:
        try:
            return requests.get(self.url + "/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False


def live(renders: list[Render]) -> Render:
    """One that runs (a reliability test kills one of them)."""
    return next(r for r in renders if r.alive())
