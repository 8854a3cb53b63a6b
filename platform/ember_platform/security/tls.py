"""The platform's own certificate authority and server certificate.

Clients trust `ca.pem` once; the server certificate can then be reissued (new
hosts, new domain, near expiry) without them having to trust anything new.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import ipaddress
import os
import secrets
import socket
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ember.errors import InvalidError
from ember.wire.labels import checked_domain

CA_VALIDITY = dt.timedelta(days=3650)
# 825 days is the longest lifetime Apple platforms accept for a server certificate.
SERVER_VALIDITY = dt.timedelta(days=825)
RENEW_BEFORE = dt.timedelta(days=30)
# Backdate a little so clients with a slightly slow clock accept a fresh certificate.
_BACKDATE = dt.timedelta(hours=1)
_WILDCARD_BINDS = frozenset({"0.0.0.0", "::"})

_San = tuple[str, str]  # ("dns", name) or ("ip", compressed address)


@dataclass(frozen=True)
class TlsFiles:
    ca_cert: Path
    server_cert: Path
    server_key: Path


def ensure_tls(state_dir: Path, *, hosts: Sequence[str], domain: str | None = None) -> TlsFiles:
    """Create the CA and a server certificate for `hosts` and `domain` if needed."""
    state_dir = Path(state_dir)
    if not state_dir.exists():
        state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(state_dir, 0o700)  # mkdir's mode is filtered by the umask
    files = TlsFiles(
        ca_cert=state_dir / "ca.pem",
        server_cert=state_dir / "server.pem",
        server_key=state_dir / "server-key.pem",
    )
    wanted = _wanted_sans(hosts, domain)
    # Two processes creating a CA at once could pair one's key with the other's cert.
    with _locked(state_dir / ".tls.lock"):
        ca_cert, ca_key = _load_or_create_ca(files.ca_cert, state_dir / "ca-key.pem")
        if not _server_cert_ok(files, ca_cert, wanted):
            _issue_server_cert(files, ca_cert, ca_key, wanted)
    return files


def _wanted_sans(hosts: Sequence[str], domain: str | None) -> set[_San]:
    """The subject alternative names the server certificate must carry."""
    sans: set[_San] = {("dns", "localhost"), ("ip", "127.0.0.1"), ("ip", "::1")}
    for host in hosts:
        host = host.strip().strip("[]")  # accept "[::1]" as written in URLs
        if not host:
            continue
        if host in _WILDCARD_BINDS:
            # Binding every interface: other machines will reach us by our name.
            hostname = socket.gethostname()
            if hostname:
                sans.add(_classify(hostname))
            continue
        sans.add(_classify(host))
    if domain is not None:
        name = checked_domain(domain)  # as routing compares it with Host headers
        sans.add(("dns", name))
        sans.add(("dns", "*." + name))
    return sans


def _classify(host: str) -> _San:
    try:
        return ("ip", ipaddress.ip_address(host).compressed)
    except ValueError:
        name = _dns_name(host.rstrip("."))
        if not name:
            raise InvalidError(f"TLS host {host!r} is not a host name or IP address") from None
        return ("dns", name)


def _dns_name(name: str) -> str:
    """Lower-case A-label form, as certificates and TLS clients compare names."""
    if name.isascii():
        return name.lower()
    try:
        return name.encode("idna").decode("ascii").lower()
    except UnicodeError as exc:
        raise InvalidError(f"TLS name {name!r} is not a valid host name: {exc}") from exc


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _load_or_create_ca(
    cert_path: Path, key_path: Path
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    if not cert_path.exists():
        # No one can trust a CA whose certificate does not exist; start afresh.
        return _create_ca(cert_path, key_path)
    if not key_path.exists():
        raise InvalidError(
            f"the CA key '{key_path}' is missing but '{cert_path}' exists; restore the key, "
            "or delete both to create a new CA (clients must then trust the new ca.pem)"
        )
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except ValueError as exc:
        raise InvalidError(
            f"cannot read the CA in '{cert_path.parent}': {exc}; delete ca.pem and "
            "ca-key.pem to create a new CA (clients must then trust the new ca.pem)"
        ) from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
        raise InvalidError(
            f"'{key_path}' is not the key of '{cert_path}'; delete both to create a new CA "
            "(clients must then trust the new ca.pem)"
        )
    return cert, key


def _create_ca(
    cert_path: Path, key_path: Path
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [x509.NameAttribute(NameOID.COMMON_NAME, f"Ember local CA {secrets.token_hex(4)}")]
    )
    not_before = _now() - _BACKDATE
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_before + CA_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(key_cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    # Key first: a crash in between leaves no ca.pem, so the next start begins again.
    _write_atomic(key_path, _key_pem(key), 0o600)
    _write_atomic(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert, key


def _server_cert_ok(files: TlsFiles, ca_cert: x509.Certificate, wanted: set[_San]) -> bool:
    try:
        cert = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
        key = serialization.load_pem_private_key(files.server_key.read_bytes(), password=None)
        cert.verify_directly_issued_by(ca_cert)
    except (OSError, ValueError, TypeError, InvalidSignature):
        return False  # missing, unreadable or from another CA: reissue
    if key.public_key() != cert.public_key():
        return False
    if cert.not_valid_after_utc - _now() < RENEW_BEFORE:
        return False
    return _cert_sans(cert) == wanted


def _cert_sans(cert: x509.Certificate) -> set[_San]:
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    sans: set[_San] = {("dns", n.lower()) for n in ext.get_values_for_type(x509.DNSName)}
    sans |= {("ip", ip.compressed) for ip in ext.get_values_for_type(x509.IPAddress)}
    return sans


def _issue_server_cert(
    files: TlsFiles,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    wanted: set[_San],
) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [
        x509.DNSName(value) if kind == "dns" else x509.IPAddress(ipaddress.ip_address(value))
        for kind, value in sorted(wanted)
    ]
    not_before = _now() - _BACKDATE
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Ember platform")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_before + SERVER_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(digital_signature=True), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    # Key first: a crash in between leaves a cert that does not match, so it is reissued.
    _write_atomic(files.server_key, _key_pem(key), 0o600)
    _write_atomic(files.server_cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)


def _key_usage(*, digital_signature: bool = False, key_cert_sign: bool = False) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=digital_signature,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=key_cert_sign,
        crl_sign=key_cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    # mkstemp creates the file 0o600, so a key is never readable by others, even briefly.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
