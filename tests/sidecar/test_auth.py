"""API keys and TLS: the sidecar's legs authenticate to engines started with a key and verify their
certificate (one real ``launch render`` server with VLLM_API_KEY and --ssl-keyfile/--ssl-certfile,
whose certificate names only ``ENGINE_NAME``), and its client port refuses requests without its own key."""

from __future__ import annotations

import datetime
import ssl
import tempfile
import urllib.request
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import requests
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from urllib3.exceptions import InsecureRequestWarning

from tests.harness.engine import early_fixture
from tests.sidecar.support import SERVED, fake_config, fake_engine, run_sidecar, wait_for
from disagg_engine.servers import ManagedServer, start, stop_all
from disagg_engine.testing.server_set import role_specs
from disagg_engine.testing.tiny_model import ensure_model
from disagg_sidecar.edge import auth
from disagg_sidecar.config import SidecarConfig

ENGINE_KEY = "engine-key-for-tests"
CLIENT_KEY = "client-key-for-tests"
CHAT = {"model": SERVED, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4}


def _key_file(tmp_path: Path, name: str, key: str) -> str:
    path = tmp_path / name
    path.write_text(key + "\n")
    return str(path)


ENGINE_NAME = "tiny-engine.tests.svc"  # the only name in the server's certificate (security.tls)


def _certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[str, ec.EllipticCurvePrivateKey] | None,
                 ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    issuer_name, signer = issuer or (subject, key)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(subject)]), critical=False)
    return builder.sign(signer, hashes.SHA256())


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


@dataclass
class KeyedServer:
    url: str  # https://127.0.0.1:port
    ca_file: str
    other_ca_file: str  # a CA that did not sign the server's certificate
    process: ManagedServer

    def stop(self) -> None:
        stop_all([self.process])


def start_keyed_render() -> KeyedServer:
    """One ``launch render`` server (the cheapest real vLLM server) requiring ENGINE_KEY, on HTTPS."""
    logs = Path(tempfile.mkdtemp(prefix="disagg-auth-"))
    ca_key, other_key, server_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    (logs / "ca.crt").write_bytes(_pem(_certificate("tests-ca", ca_key, None, ca=True)))
    (logs / "other-ca.crt").write_bytes(_pem(_certificate("tests-ca", other_key, None, ca=True)))
    (logs / "tls.crt").write_bytes(_pem(_certificate(ENGINE_NAME, server_key, ("tests-ca", ca_key), ca=False)))
    (logs / "tls.key").write_bytes(server_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                            serialization.NoEncryption()))
    [spec] = role_specs(("render",), ensure_model(), logs, env={"VLLM_API_KEY": ENGINE_KEY})
    spec = replace(spec, argv=[*spec.argv, "--ssl-keyfile", str(logs / "tls.key"), "--ssl-certfile", str(logs / "tls.crt")])
    process = start(spec, logs)
    try:
        url = f"https://127.0.0.1:{spec.port}"
        up = wait_for(lambda: _healthy(url, logs / "ca.crt") or not process.alive(), timeout=300, interval=0.5)
        assert up and process.alive(), process.log_tail()
    except BaseException:
        stop_all([process])
        raise
    return KeyedServer(url, str(logs / "ca.crt"), str(logs / "other-ca.crt"), process)


# Started in the background while the control-plane tests run (tests/harness/engine.py).
keyed_render = early_fixture("keyed_render", start_keyed_render)


def _healthy(url: str, ca_file: Path) -> bool:
    """Whether /health answers 200, the certificate verified against the test CA but not its name
    (not 127.0.0.1). It runs in the harness's start thread: no warnings filters, which are
    process-wide and would race the test running meanwhile."""
    context = ssl.create_default_context(cafile=str(ca_file))
    context.check_hostname = False
    try:
        with urllib.request.urlopen(url + "/health", context=context, timeout=30) as resp:
            return resp.status == 200
    except OSError:  # refused while it starts (URLError is an OSError)
        return False


def _insecure(method: str, url: str, **kw) -> requests.Response:
    """Straight to the server, not verifying its certificate (its name is not 127.0.0.1)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureRequestWarning)
        return requests.request(method, url, verify=False, timeout=30, **kw)


def _tls(server: KeyedServer, **overrides: str | None) -> dict:
    return {"tls": {"ca_file": server.ca_file, "server_name": ENGINE_NAME, **overrides}}


@pytest.mark.engine
def test_vllm_guards_its_api_but_not_health(keyed_render: KeyedServer) -> None:
    render = keyed_render.url + "/v1/chat/completions/render"
    body = {"model": SERVED, "messages": CHAT["messages"]}
    assert _insecure("post", render, json=body).status_code == 401
    assert _insecure("post", render, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert _insecure("post", render, json=body, headers={"Authorization": f"Bearer {ENGINE_KEY}"}).status_code == 200
    assert _insecure("get", keyed_render.url + "/health").status_code == 200


@pytest.mark.engine
def test_every_leg_carries_the_engine_key(keyed_render: KeyedServer, tmp_path: Path) -> None:
    """Render (real, keyed, HTTPS) accepts the sidecar's render leg; the fake prefill/decode engine
    sees the key on its legs and on the health probes. Without the key the render leg is refused
    (a 502 for the client: the key is the sidecar's, not theirs)."""
    with fake_engine() as engine:
        config = fake_config(engine, render={"url": keyed_render.url}, **_tls(keyed_render),
                             auth={"engine_api_key_file": _key_file(tmp_path, "engine", ENGINE_KEY)})
        with run_sidecar(config) as sidecar:
            r = requests.post(sidecar.url + "/v1/chat/completions", json=CHAT, timeout=60)
            assert r.status_code == 400 and "fake engine" in r.text, r.text  # got past render, to the fake
            assert engine.posts(), "no leg reached the engine after render"
            assert wait_for(lambda: any(c.path == "/health" for c in engine.calls), timeout=10)
            assert {c.headers.get("Authorization") for c in engine.calls} == {f"Bearer {ENGINE_KEY}"}

        del config["auth"]
        engine.calls.clear()
        with run_sidecar(config) as sidecar:
            r = requests.post(sidecar.url + "/v1/chat/completions", json=CHAT, timeout=60)
            # The engine refused the sidecar's key, not the client's: a 502 that says so, not their 401.
            assert r.status_code == 502 and "refused the sidecar's engine key (status 401)" in r.text, r.text
            assert not engine.posts(), "a leg went on after render refused it"


@pytest.mark.engine
@pytest.mark.parametrize("tls", ["no server_name", "another CA"])
def test_the_engine_certificate_is_verified(keyed_render: KeyedServer, tmp_path: Path, tls: str) -> None:
    """Dialled as 127.0.0.1 the certificate (for ENGINE_NAME only) fails verification unless
    tls.server_name names it; signed by another CA it fails whatever the name."""
    overrides = {"server_name": None} if tls == "no server_name" else {"ca_file": keyed_render.other_ca_file}
    with fake_engine() as engine:
        config = fake_config(engine, render={"url": keyed_render.url}, **_tls(keyed_render, **overrides),
                             auth={"engine_api_key_file": _key_file(tmp_path, "engine", ENGINE_KEY)})
        with run_sidecar(config) as sidecar:
            r = requests.post(sidecar.url + "/v1/chat/completions", json=CHAT, timeout=60)
            assert r.status_code in (502, 503), r.text
            assert not engine.posts()


@pytest.fixture
def guarded(tmp_path: Path) -> Iterator[tuple[str, object]]:
    with fake_engine() as engine:
        config = fake_config(engine, auth={"client_api_key_file": _key_file(tmp_path, "client", CLIENT_KEY)})
        with run_sidecar(config) as sidecar:
            yield sidecar.url, engine


@pytest.mark.parametrize("header", [None, "Bearer wrong-key", f"Basic {CLIENT_KEY}", "Bearer "])
def test_a_missing_or_wrong_client_key_gets_openais_401(guarded, header: str | None) -> None:
    url, engine = guarded
    headers = {"Authorization": header} if header is not None else {}
    for path in ("/v1/chat/completions", "/v1/completions", "/inference/v1/generate"):
        r = requests.post(url + path, json=CHAT, headers=headers, timeout=30)
        assert r.status_code == 401, (path, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
        assert CLIENT_KEY not in r.text and "wrong-key" not in r.text
        assert r.headers["WWW-Authenticate"] == "Bearer"
    assert requests.get(url + "/v1/models", headers=headers, timeout=30).status_code == 401
    assert not engine.posts()


def test_the_right_client_key_passes_and_probes_stay_open(guarded) -> None:
    url, engine = guarded
    r = requests.post(url + "/v1/chat/completions", json=CHAT, headers={"Authorization": f"bearer {CLIENT_KEY}"},
                      timeout=30)
    assert r.status_code == 400 and "fake engine" in r.text  # the fake engine's own answer
    assert all("Authorization" not in c.headers for c in engine.calls)  # the client's key stays here
    for path in ("/health", "/health/live", "/metrics"):
        assert requests.get(url + path, timeout=30).status_code == 200, path


def test_auth_is_optional_and_key_files_are_checked(tmp_path: Path) -> None:
    base = {"decode": {"url": "http://127.0.0.1:1"}}
    assert SidecarConfig.model_validate(base).auth.client_api_key_file is None
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        auth.read_key(str(empty))
    config = SidecarConfig.model_validate({**base, "auth": {"engine_api_key_file": _key_file(tmp_path, "k", "abc")}})
    assert auth.upstream_headers(config) == {"Authorization": "Bearer abc"}
    assert auth.upstream_headers(SidecarConfig.model_validate(base)) == {}
