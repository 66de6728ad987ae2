"""Layering: decisions stay pure (no aiohttp, no transport modules), transport stays at the edge."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import disagg_sidecar

PACKAGE = Path(disagg_sidecar.__file__).parent
PURE = ["allowlist", "connectors", "derender_fixes", "errors", "legs", "plan", "responses", "streaming", "usage",
        "wire", "config", "endpointslices"]
TRANSPORT = {"aiohttp", "disagg_sidecar.app", "disagg_sidecar.handlers", "disagg_sidecar.flows",
             "disagg_sidecar.exchange", "disagg_sidecar.upstream", "disagg_sidecar.keys", "disagg_sidecar.state"}


def imports(module: str) -> set[str]:
    path = PACKAGE / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = PACKAGE / module / "__init__.py"
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_do_no_io(module: str) -> None:
    bad = {n for n in imports(module) if n.split(".")[0] == "aiohttp" or n in TRANSPORT}
    assert not bad, f"{module} imports {sorted(bad)}"

