"""The platform's self-signed CA and server certificate."""

from __future__ import annotations

import datetime as dt
import ipaddress
import socket
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from ember.errors import InvalidError
from ember_platform.security import tls
from ember_platform.security.tls import TlsFiles, ensure_tls


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _sans(cert: x509.Certificate) -> set[str]:
    ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return set(ext.get_values_for_type(x509.DNSName)) | {
        str(ip) for ip in ext.get_values_for_type(x509.IPAddress)
    }


def test_creates_files_with_private_keys(tmp_path: Path) -> None:
    state = tmp_path / "state"
    files = ensure_tls(state, hosts=["127.0.0.1"])
    assert files == TlsFiles(state / "ca.pem", state / "server.pem", state / "server-key.pem")
    assert state.stat().st_mode & 0o777 == 0o700
    for name in ("ca.pem", "ca-key.pem", "server.pem", "server-key.pem"):
        assert (state / name).is_file()
    assert (state / "ca-key.pem").stat().st_mode & 0o777 == 0o600
    assert (state / "server-key.pem").stat().st_mode & 0o777 == 0o600
    assert not [p for p in state.iterdir() if p.name.startswith(".") and p.suffix != ".lock"]

    ca = _cert(files.ca_cert)
    assert ca.subject.rfc4514_string().startswith("CN=Ember local CA ")
    constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca and constraints.value.path_length == 0
    usage = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign and usage.crl_sign
    assert isinstance(ca.public_key(), ec.EllipticCurvePublicKey)
    assert ca.public_key().curve.name == "secp256r1"
    assert ca.not_valid_after_utc - ca.not_valid_before_utc == dt.timedelta(days=3650)

    server = _cert(files.server_cert)
    assert server.not_valid_after_utc - server.not_valid_before_utc == dt.timedelta(days=825)
    eku = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert _sans(server) == {"localhost", "127.0.0.1", "::1"}


def test_sans_from_hosts_and_domain(tmp_path: Path) -> None:
    files = ensure_tls(
        tmp_path,
        hosts=["0.0.0.0", "10.1.2.3", "[fd00::5]", "Gpu-Box.lan", "::"],
        domain="ember.test",
    )
    sans = _sans(_cert(files.server_cert))
    assert sans == {
        "localhost",
        "127.0.0.1",
        "::1",
        "10.1.2.3",
        "fd00::5",
        "gpu-box.lan",
        socket.gethostname().lower(),
        "ember.test",
        "*.ember.test",
    }
    assert "0.0.0.0" not in sans and "::" not in sans
    ext = _cert(files.server_cert).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert ipaddress.ip_address("10.1.2.3") in ext.value.get_values_for_type(x509.IPAddress)


def test_second_call_keeps_everything(tmp_path: Path) -> None:
    first = ensure_tls(tmp_path, hosts=["127.0.0.1"], domain="ember.test")
    before = {p.name: p.read_bytes() for p in tmp_path.glob("*.pem")}
    second = ensure_tls(tmp_path, hosts=["127.0.0.1"], domain="ember.test")
    assert second == first
    assert {p.name: p.read_bytes() for p in tmp_path.glob("*.pem")} == before


def test_new_domain_reissues_server_cert_only(tmp_path: Path) -> None:
    files = ensure_tls(tmp_path, hosts=[], domain="ember.test")
    ca_before = files.ca_cert.read_bytes()
    ca_key_before = (tmp_path / "ca-key.pem").read_bytes()
    server_before = files.server_cert.read_bytes()
    key_before = files.server_key.read_bytes()

    ensure_tls(tmp_path, hosts=[], domain="other.test")
    assert files.ca_cert.read_bytes() == ca_before
    assert (tmp_path / "ca-key.pem").read_bytes() == ca_key_before
    assert files.server_cert.read_bytes() != server_before
    assert files.server_key.read_bytes() != key_before
    assert "*.other.test" in _sans(_cert(files.server_cert))
    assert "*.ember.test" not in _sans(_cert(files.server_cert))
    assert files.server_key.stat().st_mode & 0o777 == 0o600


def test_server_cert_missing_is_reissued(tmp_path: Path) -> None:
    files = ensure_tls(tmp_path, hosts=[])
    ca_before = files.ca_cert.read_bytes()
    files.server_cert.unlink()
    ensure_tls(tmp_path, hosts=[])
    assert files.server_cert.is_file()
    assert files.ca_cert.read_bytes() == ca_before


def test_expiring_server_cert_is_reissued(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = ensure_tls(tmp_path, hosts=[])
    ca_before = files.ca_cert.read_bytes()
    server_before = files.server_cert.read_bytes()
    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=800)
    monkeypatch.setattr(tls, "_now", lambda: later)
    ensure_tls(tmp_path, hosts=[])
    assert files.ca_cert.read_bytes() == ca_before
    assert files.server_cert.read_bytes() != server_before
    assert _cert(files.server_cert).not_valid_after_utc > later + dt.timedelta(days=800)


def test_missing_ca_key_is_an_error(tmp_path: Path) -> None:
    ensure_tls(tmp_path, hosts=[])
    (tmp_path / "ca-key.pem").unlink()
    with pytest.raises(InvalidError, match=r"ca-key\.pem' is missing"):
        ensure_tls(tmp_path, hosts=[])


def test_server_cert_is_signed_by_ca(tmp_path: Path) -> None:
    files = ensure_tls(tmp_path, hosts=["127.0.0.1"])
    ca, server = _cert(files.ca_cert), _cert(files.server_cert)
    assert server.issuer == ca.subject
    ca_key = ca.public_key()
    assert isinstance(ca_key, ec.EllipticCurvePublicKey)
    assert server.signature_hash_algorithm is not None
    ca_key.verify(
        server.signature,
        server.tbs_certificate_bytes,
        ec.ECDSA(server.signature_hash_algorithm),
    )
    server.verify_directly_issued_by(ca)


@contextmanager
def _tls_server(files: TlsFiles) -> Iterator[int]:
    """Serve one TLS connection at a time on 127.0.0.1; yields the port."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(files.server_cert, files.server_key)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)  # so the loop notices `stop` soon
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(10)
                try:
                    with ctx.wrap_socket(conn, server_side=True) as tls:
                        tls.sendall(b"hello")
                except (ssl.SSLError, OSError):
                    pass  # the client refused our certificate

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(timeout=10)
        listener.close()


def _connect(port: int, ca_cert: Path, server_hostname: str) -> bytes:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = True
    ctx.load_verify_locations(ca_cert)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname=server_hostname) as tls,
    ):
        return tls.recv(5)


def test_handshake(tmp_path: Path) -> None:
    files = ensure_tls(tmp_path, hosts=["127.0.0.1"])
    with _tls_server(files) as port:
        assert _connect(port, files.ca_cert, "localhost") == b"hello"
        with pytest.raises(ssl.SSLCertVerificationError):
            _connect(port, files.ca_cert, "myapp--echo.ember.test")


def test_handshake_wildcard_domain(tmp_path: Path) -> None:
    files = ensure_tls(tmp_path, hosts=["127.0.0.1"], domain="ember.test")
    with _tls_server(files) as port:
        assert _connect(port, files.ca_cert, "myapp--echo.ember.test") == b"hello"
        assert _connect(port, files.ca_cert, "ember.test") == b"hello"
        assert _connect(port, files.ca_cert, "localhost") == b"hello"
        for wrong in ("elsewhere.test", "a.b.ember.test"):
            with pytest.raises(ssl.SSLCertVerificationError):
                _connect(port, files.ca_cert, wrong)


def test_handshake_rejects_other_ca(tmp_path: Path) -> None:
    files = ensure_tls(tmp_path / "one", hosts=[])
    other = ensure_tls(tmp_path / "two", hosts=[])
    with _tls_server(files) as port, pytest.raises(ssl.SSLCertVerificationError):
        _connect(port, other.ca_cert, "localhost")
