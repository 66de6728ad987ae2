"""scripts/oci-image writes a valid OCI archive, byte for byte the same for the same inputs (the
real node's image cache is keyed by content), with its own layer on top of cached ones. Importing
and running one is covered by test_real_node.py (one layer) and tests/e2e/test_cluster_tiny.py
(scripts/disagg-images: two)."""
from __future__ import annotations

import hashlib
import json
import subprocess
import tarfile
from pathlib import Path

from tests.harness.cluster import REPO


def build(tmp_path: Path, out: str) -> Path:
    src = tmp_path / "hello.sh"
    src.write_text("#!/bin/sh\necho hi\n")
    src.chmod(0o755)
    subprocess.run([str(REPO / "scripts" / "oci-image"), "--name", "disagg.local/t:1",
                    "--out", str(tmp_path / out), "--file", f"/bin/hello={src}", "--link", "/bin/hi=hello",
                    "--dir", "/tmp=1777",
                    "--entrypoint", '["/bin/hello"]', "--user", "65534"], check=True, timeout=60)
    return tmp_path / out


def read_archive(path: Path) -> tuple[dict[str, bytes], dict, dict]:
    """Blobs by digest, the manifest and the config of a one-image archive."""
    with tarfile.open(path) as tar:
        blobs = {m.name.split("/")[-1]: tar.extractfile(m).read()
                 for m in tar if m.name.startswith("blobs/sha256/") and m.isfile()}
        [entry] = json.load(tar.extractfile("index.json"))["manifests"]
    manifest = json.loads(blobs[entry["digest"].split(":")[1]])
    return blobs, manifest, json.loads(blobs[manifest["config"]["digest"].split(":")[1]])


def test_archive_is_a_deterministic_oci_layout(tmp_path: Path) -> None:
    first, second = build(tmp_path, "a.tar"), build(tmp_path, "b.tar")
    assert first.read_bytes() == second.read_bytes()
    with tarfile.open(first) as tar:
        blobs = {m.name.split("/")[-1]: tar.extractfile(m).read()
                 for m in tar if m.name.startswith("blobs/sha256/") and m.isfile()}
        index = json.load(tar.extractfile("index.json"))
    assert all(hashlib.sha256(data).hexdigest() == digest for digest, data in blobs.items())
    [entry] = index["manifests"]
    assert entry["annotations"]["io.containerd.image.name"] == "disagg.local/t:1"
    manifest = json.loads(blobs[entry["digest"].split(":")[1]])
    config = json.loads(blobs[manifest["config"]["digest"].split(":")[1]])
    assert config["config"]["Entrypoint"] == ["/bin/hello"] and config["config"]["User"] == "65534"
    [layer_ref] = manifest["layers"]
    layer = blobs[layer_ref["digest"].split(":")[1]]
    assert config["rootfs"]["diff_ids"] == [layer_ref["digest"]]
    (tmp_path / "layer.tar").write_bytes(layer)
    with tarfile.open(tmp_path / "layer.tar") as tar:
        members = {m.name: m for m in tar}
    assert list(members) == sorted(members)  # parents before children
    assert members["bin/hello"].mode == 0o755
    assert members["bin/hi"].issym() and members["bin/hi"].linkname == "hello"
    assert members["tmp"].isdir() and members["tmp"].mode == 0o1777
    assert members["bin"].isdir()


def test_tree_keeps_links_and_modes_and_env_replaces_the_default(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "opt" / "app" / "bin").mkdir(parents=True)
    (root / "opt" / "app" / "bin" / "run").write_text("#!/bin/sh\n")
    (root / "opt" / "app" / "bin" / "run").chmod(0o750)
    (root / "opt" / "app" / "current").symlink_to("bin")
    out = tmp_path / "tree.tar"
    subprocess.run([str(REPO / "scripts" / "oci-image"), "--name", "disagg.local/tree:1", "--out", str(out),
                    f"--tree=/={root}", "--env=PATH=/opt/app/bin", "--env=HOME=/tmp", "--workdir=/tmp"],
                   check=True, timeout=60)
    blobs, manifest, image = read_archive(out)
    config = image["config"]
    assert config["Env"] == ["PATH=/opt/app/bin", "HOME=/tmp"] and config["WorkingDir"] == "/tmp"
    (tmp_path / "layer.tar").write_bytes(blobs[manifest["layers"][0]["digest"].split(":")[1]])
    with tarfile.open(tmp_path / "layer.tar") as tar:
        members = {m.name: m for m in tar}
    assert members["opt/app/bin/run"].mode == 0o750 and members["opt/app/bin/run"].isfile()
    assert members["opt/app/current"].issym() and members["opt/app/current"].linkname == "bin"
    assert list(members) == sorted(members)


def test_an_image_stacks_its_layer_on_cached_base_layers(tmp_path: Path) -> None:
    base_root = tmp_path / "base"
    (base_root / "etc").mkdir(parents=True)
    (base_root / "etc" / "os").write_text("base\n")
    base = tmp_path / "base.layer"
    subprocess.run([str(REPO / "scripts" / "oci-image"), "--layer-only", "--out", str(base), f"--tree=/={base_root}"],
                   check=True, timeout=60)
    with tarfile.open(base) as tar:  # a plain layer tar, not an image layout
        assert [m.name for m in tar] == ["etc", "etc/os"]
    app = tmp_path / "app.sh"
    app.write_text("#!/bin/sh\n")
    images = []
    for out in ("a.tar", "b.tar"):
        subprocess.run([str(REPO / "scripts" / "oci-image"), "--name", "disagg.local/stack:1", "--out",
                        str(tmp_path / out), "--base", str(base), f"--file=/bin/app={app}"], check=True, timeout=60)
        images.append((tmp_path / out).read_bytes())
    assert images[0] == images[1]
    blobs, manifest, config = read_archive(tmp_path / "a.tar")
    base_digest = "sha256:" + hashlib.sha256(base.read_bytes()).hexdigest()
    digests = [layer["digest"] for layer in manifest["layers"]]
    assert digests[0] == base_digest and len(digests) == 2  # lowest first
    assert config["rootfs"]["diff_ids"] == digests
    assert [layer["size"] for layer in manifest["layers"]] == [len(blobs[d.split(":")[1]]) for d in digests]
    assert all(hashlib.sha256(data).hexdigest() == digest for digest, data in blobs.items())
    (tmp_path / "top.tar").write_bytes(blobs[digests[1].split(":")[1]])
    with tarfile.open(tmp_path / "top.tar") as tar:
        assert [m.name for m in tar] == ["bin", "bin/app"]
