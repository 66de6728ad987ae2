"""The Disagg images for the real node (``disagg_cli.cluster.node``), written as OCI archives without a
registry or a daemon (``oci``), cached by content in ~/.cache/disagg/images:

  disagg.local/disagg:local    what the Dockerfile builds: the operator and the sidecar (`disagg`),
                               Python 3.11 with the project's light dependencies, uid 10001
  disagg.local/vllm-cpu:local  the CPU engine for every pool: the same Python with `disagg` (the
                               engine extension's entry point included), `vllm` on PATH, uid 1000.
                               vLLM and torch are NOT copied in (~6 GB): the image's site-packages
                               adds the dependency tree of `make setup` from the host cache, which
                               pods mount read-only through a PersistentVolumeClaim named
                               disagg-host-cache (a hostPath PV that the real node creates), as
                               model.source pvc://disagg-host-cache/... mounts it at /models/disagg-host-cache.

  scripts/disagg-images            build what is missing; print "<name> <archive>" per image
  scripts/disagg-images --import   also import them into the running real node's containerd

The Python runtime (the interpreter `make setup` used) and the shared libraries every ELF file in
the image needs (ldd) are copied from the host, at the same paths. Runs on .venv's python (it reads
the dependency tree from its sys.path).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

from disagg_cli.cluster import node_config
from disagg_cli.cluster.layout import REPO, cache_dir, state_dir
from disagg_cli.images import oci

CACHE = cache_dir(dict(os.environ))
OPERATOR_IMAGE = "disagg.local/disagg:local"
ENGINE_IMAGE = "disagg.local/vllm-cpu:local"
HOST_CACHE_CLAIM = node_config.HOST_CACHE_VOLUME  # its claim is named as the volume (examples/cluster-tiny.yaml)
SOURCES = ("pyproject.toml", "operator", "sidecar", "engine", "cli")  # what the Dockerfile copies
RUNTIME_SKIP = {"site-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "config-3.11-x86_64-linux-gnu"}
PASSWD = "root:x:0:0:root:/root:/bin/sh\nvllm:x:1000:1000:vllm:/var/cache/disagg:/bin/sh\ndisagg:x:10001:10001:disagg:/nonexistent:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/sh\n"
GROUP = "root:x:0:\nvllm:x:1000:\ndisagg:x:10001:\nnogroup:x:65534:\n"
SCRIPT = "#!/opt/disagg/bin/python\nimport sys\nfrom {module} import main\nsys.exit(main())\n"
# `vllm serve MODEL ...` and `vllm launch render MODEL ...` as the operator runs them, through vLLM's
# server modules: the `vllm` console script looks up a `vllm` distribution, and this one is vllm-cpu
# (local mode does the same, cli/disagg_cli/local/plan.py).
VLLM_SCRIPT = """#!/opt/disagg/bin/python
import os, sys
MODULES = {("serve",): "vllm.entrypoints.launchers.api_server.entry",
           ("launch", "render"): "vllm.entrypoints.launchers.render.entry"}
args = sys.argv[1:]
for prefix, module in MODULES.items():
    if tuple(args[:len(prefix)]) == prefix:
        rest = args[len(prefix):]
        if rest and not rest[0].startswith("-"):
            rest = ["--model", *rest]
        os.execv(sys.executable, [sys.executable, "-m", module, *rest])
from vllm.entrypoints.cli.main import main
sys.exit(main())
"""


def deps_site_packages() -> Path:
    """The dependency tree's site-packages (run by .venv/bin/python: it is on sys.path)."""
    return next(p for p in map(Path, sys.path) if (p / "vllm").is_dir() and (p / "torch").is_dir())


def digest_tree(h: "hashlib._Hash", root: Path) -> None:
    for path in sorted(root.rglob("*")) if root.is_dir() else [root]:
        if path.is_file() and "__pycache__" not in path.parts and ".egg-info" not in str(path):
            h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())


def base_key(deps: Path, kind: str) -> str:
    """The lower layer's key: everything but the project's own code (its dependencies'
    closure comes from pyproject.toml)."""
    h = hashlib.sha256(kind.encode())
    for path in (Path(__file__), Path(oci.__file__), REPO / "pyproject.toml"):
        h.update(path.read_bytes())
    h.update(f"{sys.base_prefix}|{sys.version}|{deps}".encode())
    return h.hexdigest()[:16]


def cache_key(deps: Path, kind: str) -> str:
    h = hashlib.sha256(base_key(deps, kind).encode())
    for name in SOURCES:
        digest_tree(h, REPO / name)
    return h.hexdigest()[:16]


def link_tree(src: Path, dst: Path, skip: set[str] = set()) -> None:
    """Hard links (same filesystem) or copies: the layer reads them once."""
    def copy(s: str, d: str) -> None:
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)
    shutil.copytree(src, dst, symlinks=True, copy_function=copy, dirs_exist_ok=True,
                    ignore=lambda _d, names: [n for n in names if n in skip])


def build_wheel(tmp: Path) -> Path:
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:  # a copy: building in the repo would leave build/ and *.egg-info there
        if (REPO / name).is_file():
            shutil.copy2(REPO / name, src / name)
        else:
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-q", "-w", str(tmp / "wheel"), str(src)], check=True)
    return next((tmp / "wheel").glob("disagg-*.whl"))


def light_dependencies(deps: Path) -> list[metadata.Distribution]:
    """The closure of the project's own dependencies (pyproject.toml), as installed in ``deps``."""
    from packaging.requirements import Requirement  # in the dependency tree (pip's, setuptools')

    dists = {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower(): d for d in metadata.distributions(path=[str(deps)])}
    todo = list(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"])
    seen: dict[str, metadata.Distribution] = {}
    while todo:
        req = Requirement(todo.pop())
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        if name in seen:
            continue
        seen[name] = dists[name]
        todo += seen[name].requires or []
    return list(seen.values())


def copy_distribution(dist: metadata.Distribution, deps: Path, site: Path) -> None:
    """The distribution's top-level packages, whole. A namespace package several distributions share
    (``opentelemetry/``) is copied once, by the first of them: the whole directory, theirs included."""
    tops = {f.parts[0] for f in dist.files or [] if not f.parts[0].startswith("..")}
    for top in tops:
        src = deps / top
        if src.is_dir():
            if not (site / top).exists():
                link_tree(src, site / top)
        elif src.is_file():
            shutil.copy2(src, site / top)


def ldd(files: list[Path]) -> set[str]:
    """System libraries the ELF files need (paths outside the staged tree)."""
    found: set[str] = set()
    for i in range(0, len(files), 200):
        out = subprocess.run(["ldd", *map(str, files[i:i + 200])], capture_output=True, text=True).stdout
        found |= set(re.findall(r"=> (/\S+) \(", out)) | set(re.findall(r"^\s+(/\S+) \(", out, re.M))
    return found


def elf_files(root: Path) -> list[Path]:
    out = []
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink() and (p.suffix == ".so" or ".so." in p.name or os.access(p, os.X_OK)):
            with open(p, "rb") as fh:
                if fh.read(4) == b"\x7fELF":
                    out.append(p)
    return out


VENV = Path("/opt/disagg")
SITE = VENV / "lib" / "python3.11" / "site-packages"


def stage_base(kind: str, deps: Path, root: Path) -> None:
    """Lay out the image's lower layer in ``root``: everything but the project's own package."""
    runtime = Path(sys.base_prefix)
    for sub in ("bin", "lib"):
        (root / runtime.relative_to("/") / sub).mkdir(parents=True)
    exe = runtime / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    shutil.copy2(exe, root / exe.relative_to("/"))
    for lib in (runtime / "lib").glob("libpython3*.so*"):
        shutil.copy2(lib, root / lib.relative_to("/"), follow_symlinks=True)
    stdlib = Path(sysconfig.get_paths(vars={"installed_base": str(runtime), "base": str(runtime)})["stdlib"])
    link_tree(stdlib, root / stdlib.relative_to("/"), RUNTIME_SKIP)

    venv = root / VENV.relative_to("/")
    site = root / SITE.relative_to("/")
    site.mkdir(parents=True)
    (venv / "bin").mkdir()
    os.symlink(exe, venv / "bin" / "python")
    (venv / "pyvenv.cfg").write_text(f"home = {exe.parent}\ninclude-system-site-packages = false\n"
                                     f"version = {'.'.join(map(str, sys.version_info[:3]))}\n")
    scripts = {"disagg": "disagg_cli.main"}
    if kind == "operator":
        deps_site = deps / "lib" / "python3.11" / "site-packages"
        for dist in light_dependencies(deps_site):
            copy_distribution(dist, deps_site, site)
    else:
        mounted = f"/models/{HOST_CACHE_CLAIM}/{deps.relative_to(CACHE)}/lib/python3.11/site-packages"
        (site / "_disagg_deps.pth").write_text(f"import site; site.addsitedir({mounted!r})\n")
        (venv / "bin" / "vllm").write_text(VLLM_SCRIPT)
        (venv / "bin" / "vllm").chmod(0o755)
    (root / "bin").mkdir()
    if kind == "engine":  # vLLM reads the CPU topology from `lscpu -J` (through /bin/sh)
        shutil.copy2("/usr/bin/lscpu", root / "bin" / "lscpu")
    shutil.copy2("/bin/busybox", root / "bin" / "busybox")
    os.symlink("busybox", root / "bin" / "sh")
    for name, module in scripts.items():
        (venv / "bin" / name).write_text(SCRIPT.format(module=module))
        (venv / "bin" / name).chmod(0o755)

    elves = elf_files(root) + (elf_files(deps) if kind == "engine" else [])
    for lib in sorted(ldd(elves)):
        if lib.startswith(str(deps)) or lib.startswith(str(runtime)):
            continue
        real = Path(lib).resolve()
        dst = root / "usr" / "lib" / "x86_64-linux-gnu" / Path(lib).name
        if not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(real, dst)
    (root / "lib64").mkdir(exist_ok=True)
    os.symlink("../usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2", root / "lib64" / "ld-linux-x86-64.so.2")
    os.symlink("usr/lib", root / "lib")
    (root / "etc").mkdir()
    (root / "etc" / "passwd").write_text(PASSWD)
    (root / "etc" / "group").write_text(GROUP)


def config_args(kind: str) -> list[str]:
    """oci-image arguments for the image's config."""
    env = ["PATH=/opt/disagg/bin:/bin:/usr/bin", "PYTHONUNBUFFERED=1", "PYTHONDONTWRITEBYTECODE=1", "HOME=/tmp"]
    args = [f"--env={e}" for e in env] + ["--dir=/tmp=1777", "--workdir=/tmp"]
    if kind == "operator":
        return args + ['--entrypoint=["disagg"]', '--cmd=["--help"]', "--user=10001:10001"]
    return args + ['--cmd=["vllm", "--help"]', "--user=1000:1000"]


def cached(out_dir: Path, prefix: str, key: str, suffix: str) -> Path:
    """``out_dir/prefix-key.suffix``, after removing that kind's files of other keys (hundreds of MB each)."""
    out = out_dir / f"{prefix}-{key}.{suffix}"
    for old in out_dir.glob(f"{prefix}-*.{suffix}"):
        if old != out:
            old.unlink()
    return out


def build(kind: str, name: str, deps: Path, out_dir: Path) -> Path:
    """Two layers: the runtime and dependencies (rebuilt when they change: ``ldd`` over the whole
    dependency tree for the engine), and the project's wheel on top (rebuilt per source change)."""
    prefix = name.split("/")[-1].split(":")[0]
    out = cached(out_dir, prefix, cache_key(deps, kind), "tar")
    if out.exists():
        return out
    base = cached(out_dir, f"{prefix}-base", base_key(deps, kind), "layer")
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".stage.") as t:
        tmp = Path(t)
        if not base.exists():
            stage_base(kind, deps, tmp / "base")
            oci.main(["--layer-only", "--out", str(base), f"--tree=/={tmp / 'base'}"])
        site = tmp / "app" / SITE.relative_to("/")
        site.mkdir(parents=True)
        with zipfile.ZipFile(build_wheel(tmp)) as zf:
            zf.extractall(site)
        oci.main(["--name", name, "--out", str(out), "--base", str(base), f"--tree=/={tmp / 'app'}", *config_args(kind)])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="scripts/disagg-images", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--import", dest="do_import", action="store_true")
    args = ap.parse_args()
    deps = deps_site_packages().parents[2]
    # The engines run as uid 1000 and read the models through the host-cache volume.
    for path in [*(CACHE / "models").rglob("*"), CACHE / "models"]:
        if path.is_dir() and not path.is_symlink():
            path.chmod(path.stat().st_mode | 0o555)
        elif path.is_file():
            path.chmod(path.stat().st_mode | 0o444)
    out_dir = CACHE / "images"
    out_dir.mkdir(parents=True, exist_ok=True)
    built = [(n, build(k, n, deps, out_dir)) for k, n in (("operator", OPERATOR_IMAGE), ("engine", ENGINE_IMAGE))]
    if args.do_import:
        node = node_config.NodeDir(state_dir(dict(os.environ)) / "node", state_dir(dict(os.environ)) / "pki")
        for _, archive in built:
            subprocess.run(["ctr", "--address", str(node.socket), "-n", node_config.CTR_NAMESPACE,
                            "images", "import", str(archive)], check=True, stdout=subprocess.DEVNULL)
    for name, archive in built:
        print(name, archive)


if __name__ == "__main__":
    main()
