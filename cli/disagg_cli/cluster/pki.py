"""The cluster's certificates (openssl) and self-contained kubeconfigs.

EC P-256 keys: generated in milliseconds, accepted by every component (incl. SA token signing).
The real node (``node.py``) issues its certificates with the same CA.
"""

from __future__ import annotations

import base64
import subprocess
from collections.abc import Iterable
from pathlib import Path

from disagg_cli.cluster.layout import API_SERVICE_IP, CLUSTER_DOMAIN

# openssl x509 -extfile texts: a client certificate, and a server's for the names it is reached by.
CLIENT = "extendedKeyUsage=clientAuth\nkeyUsage=critical,digitalSignature"


def server(names: Iterable[str]) -> str:
    """A serving certificate's extensions for ``names`` (``IP:...``, ``DNS:...``)."""
    return f"subjectAltName={','.join(names)}\nextendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature"


APISERVER = server(["IP:127.0.0.1", f"IP:{API_SERVICE_IP}", "DNS:localhost", "DNS:kubernetes", "DNS:kubernetes.default",
                    "DNS:kubernetes.default.svc", f"DNS:kubernetes.default.svc.{CLUSTER_DOMAIN}"])


def _openssl(*args: str, quiet: bool = False, input: str | None = None) -> None:
    subprocess.run(["openssl", *args], check=True, text=True, input=input,
                   stdin=None if input is not None else subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL if quiet else None)


def new_key(path: Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path), quiet=True)


def new_ca(pki: Path, name: str, cn: str) -> None:
    new_key(pki / f"{name}.key")
    _openssl("req", "-x509", "-new", "-key", str(pki / f"{name}.key"), "-subj", f"/CN={cn}", "-days", "3650",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             "-out", str(pki / f"{name}.crt"))


def issue(pki: Path, name: str, subject: str, extensions: str, ca: str = "ca") -> None:
    """A key and a certificate for ``subject`` (e.g. ``/O=group/CN=user``) signed by ``ca``."""
    key, csr = pki / f"{name}.key", pki / f"{name}.csr"
    new_key(key)
    _openssl("req", "-new", "-key", str(key), "-subj", subject, "-out", str(csr))
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(pki / f"{ca}.crt"), "-CAkey", str(pki / f"{ca}.key"),
             "-CAcreateserial", "-days", "3650", "-extfile", "/dev/stdin", "-out", str(pki / f"{name}.crt"),
             quiet=True, input=extensions + "\n")
    csr.unlink()


def make_pki(pki: Path) -> None:
    pki.mkdir(parents=True, exist_ok=True)
    new_ca(pki, "ca", "disagg-test-ca")
    # Front-proxy (request-header) CA: the aggregation layer needs it, and without it the
    # scheduler's and KCM's delegated authentication log an error every minute.
    new_ca(pki, "front-proxy-ca", "disagg-front-proxy-ca")
    issue(pki, "apiserver", "/CN=kube-apiserver", APISERVER)
    issue(pki, "admin", "/O=system:masters/CN=disagg-admin", CLIENT)
    issue(pki, "apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client", CLIENT)  # logs/exec
    issue(pki, "kube-controller-manager", "/CN=system:kube-controller-manager", CLIENT)
    issue(pki, "kube-scheduler", "/CN=system:kube-scheduler", CLIENT)
    issue(pki, "kwok", "/O=system:masters/CN=kwok-controller", CLIENT)  # kwok patches nodes and pods
    issue(pki, "front-proxy-client", "/CN=front-proxy-client", CLIENT, ca="front-proxy-ca")
    new_key(pki / "sa.key")
    _openssl("pkey", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))


def kubeconfig_text(user: str, api_port: int, ca: bytes, cert: bytes, key: bytes) -> str:
    """A kubeconfig with the certificates embedded (it works from any directory)."""
    b64 = lambda data: base64.b64encode(data).decode()  # noqa: E731
    return f"""apiVersion: v1
kind: Config
clusters:
- name: disagg
  cluster:
    server: https://127.0.0.1:{api_port}
    certificate-authority-data: {b64(ca)}
users:
- name: {user}
  user:
    client-certificate-data: {b64(cert)}
    client-key-data: {b64(key)}
contexts:
- name: disagg
  context: {{cluster: disagg, user: {user}}}
current-context: disagg
"""


def write_kubeconfig(pki: Path, user: str, api_port: int, path: Path) -> None:
    """``user``'s kubeconfig from pki/<user>.crt and .key."""
    text = kubeconfig_text(user, api_port, (pki / "ca.crt").read_bytes(), (pki / f"{user}.crt").read_bytes(),
                           (pki / f"{user}.key").read_bytes())
    path.write_text(text)
