"""Write an OCI image archive from host files, for `ctr images import` (no registry, no daemon).
Deterministic: the same inputs give the same bytes, so the archive is cached by content.

  scripts/oci-image --name disagg.local/busybox:test --out busybox.tar \
      --file /bin/busybox=/usr/bin/busybox --link /bin/sh=busybox --dir /tmp=1777 \
      --entrypoint '["/bin/sh"]' [--cmd '[...]'] [--user 65534] [--base LAYER.tar ...]
  scripts/oci-image --layer-only --out LAYER.tar --tree /=rootfs ...

--layer-only writes the entries as one layer tar, to be cached and given as --base (repeatable,
lowest first) to images whose own layer goes on top: an image whose upper layer changes often
rewrites and re-imports only that layer's files (containerd unpacks a layer it has once).

--file DST=SRC copies SRC (mode kept); --link DST=TARGET adds a symlink; --dir DST=MODE an
empty directory (octal mode); --tree DST=SRC a directory with everything under it (symlinks kept
as links, modes kept). Parents of every entry are added as 0755 directories. --env K=V (repeatable)
replaces the default PATH. The layer is streamed through a temporary file next to --out, so images
of hundreds of MB need no more memory than small ones.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

LAYER = "application/vnd.oci.image.layer.v1.tar"


def _entries(args: argparse.Namespace) -> list[tarfile.TarInfo | tuple[tarfile.TarInfo, str]]:
    """TarInfo entries (files paired with their source path), parents first, sorted for determinism."""
    items: dict[str, tarfile.TarInfo | tuple[tarfile.TarInfo, str]] = {}

    def info(path: str, kind: bytes, mode: int) -> tarfile.TarInfo:
        ti = tarfile.TarInfo(path.lstrip("/"))
        ti.type, ti.mode, ti.mtime, ti.uid, ti.gid = kind, mode, 0, 0, 0
        for parent in list(PurePosixPath(ti.name).parents)[:-1]:
            items.setdefault(str(parent), _dir(str(parent), 0o755))
        return ti

    def _dir(path: str, mode: int) -> tarfile.TarInfo:
        ti = tarfile.TarInfo(path)
        ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, mode, 0
        return ti

    for spec in args.dir:
        dst, mode = spec.split("=", 1)
        items[dst.lstrip("/")] = info(dst, tarfile.DIRTYPE, int(mode, 8))
    for spec in args.link:
        dst, target = spec.split("=", 1)
        ti = info(dst, tarfile.SYMTYPE, 0o777)
        ti.linkname = target
        items[ti.name] = ti
    def add_file(dst: str, src: str) -> None:
        st = os.stat(src)
        ti = info(dst, tarfile.REGTYPE, st.st_mode & 0o7777)
        ti.size = st.st_size
        items[ti.name] = (ti, src)

    for spec in args.tree:
        dst, src = spec.split("=", 1)
        root = Path(src)
        for path in sorted(root.rglob("*")):
            target = str(PurePosixPath(dst) / path.relative_to(root).as_posix())
            if path.is_symlink():
                ti = info(target, tarfile.SYMTYPE, 0o777)
                ti.linkname = os.readlink(path)
                items[ti.name] = ti
            elif path.is_dir():
                items[target.lstrip("/")] = info(target, tarfile.DIRTYPE, path.stat().st_mode & 0o7777)
            elif path.is_file():
                add_file(target, str(path))
    for spec in args.file:
        add_file(*spec.split("=", 1))
    return [items[k] for k in sorted(items)]


def write_layer(args: argparse.Namespace, out: Path) -> None:
    """The layer tar into ``out``."""
    with open(out, "wb") as fh:
        with tarfile.open(fileobj=fh, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for entry in _entries(args):
                if isinstance(entry, tuple):
                    with open(entry[1], "rb") as src:
                        tar.addfile(entry[0], src)
                else:
                    tar.addfile(entry)


def blob(data: bytes) -> tuple[str, bytes]:
    return "sha256:" + hashlib.sha256(data).hexdigest(), data


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def write_archive(args: argparse.Namespace, out: Path, tmp: Path) -> None:
    layer_path = tmp / "layer.tar"
    write_layer(args, layer_path)
    layers = [(Path(b), file_digest(Path(b)), Path(b).stat().st_size) for b in args.base]
    layers.append((layer_path, file_digest(layer_path), layer_path.stat().st_size))
    config = {
        "architecture": "amd64", "os": "linux",
        "config": {"Env": args.env or ["PATH=/bin:/usr/bin"], "Entrypoint": args.entrypoint, "Cmd": args.cmd,
                   "User": args.user, "WorkingDir": args.workdir},
        "rootfs": {"type": "layers", "diff_ids": [digest for _, digest, _ in layers]},
    }
    config_digest, config_raw = blob(json.dumps(config, sort_keys=True).encode())
    manifest = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": config_digest, "size": len(config_raw)},
        "layers": [{"mediaType": LAYER, "digest": digest, "size": size} for _, digest, size in layers],
    }
    manifest_digest, manifest_raw = blob(json.dumps(manifest, sort_keys=True).encode())
    index = {"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": manifest_digest,
        "size": len(manifest_raw),
        # ctr names the imported image after this annotation.
        "annotations": {"io.containerd.image.name": args.name,
                        "org.opencontainers.image.ref.name": args.name.rsplit(":", 1)[-1]},
    }]}
    files = {"oci-layout": b'{"imageLayoutVersion":"1.0.0"}', "index.json": json.dumps(index).encode()}
    for digest, data in ((config_digest, config_raw), (manifest_digest, manifest_raw)):
        files["blobs/sha256/" + digest.split(":")[1]] = data
    with tarfile.open(out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in ("blobs", "blobs/sha256"):
            ti = tarfile.TarInfo(name)
            ti.type, ti.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(ti)
        for path, digest, size in layers:
            ti = tarfile.TarInfo("blobs/sha256/" + digest.split(":")[1])
            ti.size, ti.mode = size, 0o644
            with open(path, "rb") as layer:
                tar.addfile(ti, layer)
        for name, data in files.items():
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode = len(data), 0o644
            tar.addfile(ti, io.BytesIO(data))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="scripts/oci-image", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name")
    ap.add_argument("--out", required=True)
    ap.add_argument("--file", action="append", default=[])
    ap.add_argument("--link", action="append", default=[])
    ap.add_argument("--dir", action="append", default=[])
    ap.add_argument("--tree", action="append", default=[])
    ap.add_argument("--env", action="append", default=[])
    ap.add_argument("--workdir", default="/")
    ap.add_argument("--entrypoint", type=json.loads, default=None)
    ap.add_argument("--cmd", type=json.loads, default=None)
    ap.add_argument("--user", default="")
    ap.add_argument("--base", action="append", default=[], help="a layer tar below this image's own")
    ap.add_argument("--layer-only", action="store_true", help="write the layer tar, not an image")
    args = ap.parse_args(argv)
    if not args.layer_only and not args.name:
        ap.error("--name is required for an image")
    out = Path(args.out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if args.layer_only:
            write_layer(args, tmp / "archive.tar")
        else:
            write_archive(args, tmp / "archive.tar", tmp)
        os.replace(tmp / "archive.tar", out)  # readers never see a partial archive
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
