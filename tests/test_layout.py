"""Project layout promises: light packages stay light, the CLI dispatches, the model cache is keyed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("package", ["disagg_sidecar", "disagg_operator", "disagg_cli"])
def test_light_packages_do_not_import_vllm_or_torch(package):
    code = (
        "import importlib, pkgutil, sys\n"
        f"pkg = importlib.import_module({package!r})\n"
        "for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "    if not m.name.endswith('.__main__'):  # entry points run, not import\n"
        "        importlib.import_module(m.name)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch', 'transformers'))\n"
        "print(heavy)\n"
        "sys.exit(1 if heavy else 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_import_contracts_are_kept():
    """The layering contracts of pyproject.toml's [tool.importlinter], checked by import-linter:
    light packages stay light, the sidecar stands alone, the operator reads only the sidecar's
    configuration and connectors, the engine only wire names, nothing imports the CLI, and the
    decisions of the operator and the sidecar do no I/O."""
    code = "import sys; from importlinter.cli import lint_imports_command; sys.argv = ['lint-imports']; lint_imports_command()"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0 and " 0 broken" in out.stdout, out.stdout[-4000:] + out.stderr[-2000:]


PACKAGES = ("disagg_operator", "disagg_sidecar", "disagg_engine", "disagg_cli")


def import_cycles(graph: grimp.ImportGraph, packages: tuple[str, ...]) -> list[list[str]]:
    """The modules of ``packages`` that import each other in a circle, one sorted list per circle
    (Tarjan's strongly connected components; imports under TYPE_CHECKING count too)."""
    inside = sorted(m for m in graph.modules if m.split(".")[0] in packages)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported.split(".")[0] not in packages:
                continue
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in inside:
        if module not in index:
            visit(module)
    return sorted(cycles)


def test_the_cycle_finder_finds_circles():
    graph = grimp.ImportGraph()
    for importer, imported in [("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d"),
                               ("p.d", "p.e"), ("p.e", "p.d"), ("p.f", "p.a"), ("p.a", "os")]:
        graph.add_import(importer=importer, imported=imported)
    assert import_cycles(graph, ("p",)) == [["p.a", "p.b", "p.c"], ["p.d", "p.e"]]
    graph.remove_import(importer="p.e", imported="p.d")
    assert import_cycles(graph, ("p",)) == [["p.a", "p.b", "p.c"]]


def test_no_import_cycles():
    """No module of the four packages imports itself through others: each layer reads only the ones below."""
    assert import_cycles(grimp.build_graph(*PACKAGES), PACKAGES) == []


def test_top_level_folders_are_not_packages():
    # A package named `operator` would shadow the stdlib module.
    for folder in ("operator", "sidecar", "engine", "cli"):
        assert not (ROOT / folder / "__init__.py").exists()
    import operator

    assert Path(operator.__file__).parent != ROOT / "operator"


MAX_MODULE_LINES = 500  # modules split by concept, not by size; this is only the ceiling
MAX_README_LINES = 150  # the README is for users; development notes go in docs/


def test_modules_and_readme_stay_small():
    packages = [ROOT / f / f"disagg_{f}" for f in ("operator", "sidecar", "engine", "cli")]
    long = {str(p.relative_to(ROOT)): n for pkg in packages for p in pkg.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
    assert len((ROOT / "README.md").read_text().splitlines()) <= MAX_README_LINES


def test_cli_lists_and_rejects_commands():
    help_ = subprocess.run([sys.executable, "-m", "disagg_cli.main", "--help"], capture_output=True, text=True)
    assert help_.returncode == 0
    for name in ("crd", "manifests", "operator", "sidecar", "engine", "up", "status"):
        assert f"  {name}" in help_.stdout
    bad = subprocess.run([sys.executable, "-m", "disagg_cli.main", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown command 'nope'" in bad.stderr


def test_tiny_model_key_changes_with_the_recipe(monkeypatch):
    from disagg_engine.testing import tiny_model

    key = tiny_model.recipe_key()
    assert key == tiny_model.recipe_key()
    monkeypatch.setitem(tiny_model.RECIPE, "hidden_size", 256)
    assert tiny_model.recipe_key() != key


def test_engine_command_adds_the_plugin_and_scale_out():
    from disagg_engine.commands import serve_argv, with_plugin

    assert with_plugin(None) == "disagg"
    assert with_plugin("foo,disagg") == "foo,disagg"
    assert with_plugin("foo") == "foo,disagg"
    argv = serve_argv(["/models/x", "--port", "9000"])
    assert argv[1:4] == ["-m", "vllm.entrypoints.launchers.api_server.entry", "--model"]
    assert argv[4] == "/models/x" and argv[-1] == "--enable-scale-out"
    assert serve_argv(["m", "--tokens-only"])[-1] == "--tokens-only"
