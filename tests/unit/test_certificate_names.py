"""Which handshakes get the operator's certificate, and what an operator is warned of."""

from __future__ import annotations

import datetime as dt
import ssl
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ember.errors import ConfigError
from ember_platform.security.own_certificate import (
    LoadedCertificate,
    OwnCertificate,
    covers,
    load_certificate,
    warnings_for,
)

NAMES = ("ember.example.com", "*.ember.example.com")


@pytest.mark.parametrize(
    ("server_name", "expected"),
    [
        ("ember.example.com", True),
        ("EMBER.example.com.", True),
        ("app--web.ember.example.com", True),
        ("a.b.ember.example.com", False),  # a wildcard is one label
        ("ember.example.com.evil.org", False),
        ("example.com", False),
        ("127.0.0.1", False),
        (None, False),
        ("", False),
    ],
)
def test_a_name_is_covered_exactly_or_by_a_one_label_wildcard(
    server_name: str | None, expected: bool
) -> None:
    assert covers(NAMES, server_name) is expected


def write_pair(folder: Path, names: list[str], days: float = 30.0) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test")])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=days))
    )
    if names:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), False
        )
    cert = builder.sign(key, hashes.SHA256())
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def test_a_pair_loads_with_its_names_in_lower_case(tmp_path: Path) -> None:
    cert, key = write_pair(tmp_path, ["Ember.Example.com", "*.ember.example.com"])
    loaded = load_certificate(cert, key)
    assert loaded.names == NAMES
    assert isinstance(loaded.context, ssl.SSLContext)


def test_pairs_that_cannot_be_served_are_said_why(tmp_path: Path) -> None:
    cert, key = write_pair(tmp_path, [])
    with pytest.raises(ConfigError, match="names no DNS name"):
        load_certificate(cert, key)
    with pytest.raises(ConfigError, match=r"--tls-cert .*missing.pem: no such file"):
        load_certificate(tmp_path / "missing.pem", key)
    with pytest.raises(ConfigError, match=r"--tls-key .*gone.pem: no such file"):
        load_certificate(cert, tmp_path / "gone.pem")
    with pytest.raises(ConfigError, match="is not a PEM certificate \\(is it the key\\?\\)"):
        load_certificate(key, key)
    with pytest.raises(
        ConfigError, match="is not a PEM private key \\(is it the certificate\\?\\)"
    ):
        load_certificate(cert, cert)
    other = tmp_path / "other"
    other.mkdir()
    cert, _ = write_pair(tmp_path, ["a.example"])
    _, other_key = write_pair(other, ["a.example"])
    with pytest.raises(ConfigError, match="the key does not belong to the certificate"):
        load_certificate(cert, other_key)


def test_operators_hear_of_expiry_and_of_a_domain_it_does_not_cover() -> None:
    now = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)

    def loaded(days: float, names: tuple[str, ...] = NAMES) -> LoadedCertificate:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        return LoadedCertificate(context, names, now + dt.timedelta(days=days), 1)

    assert warnings_for(loaded(60), "ember.example.com", now) == []
    assert warnings_for(loaded(3), None, now) == [
        "the --tls-cert certificate expires on 2026-12-04"
    ]
    assert warnings_for(loaded(-1), None, now) == [
        "the --tls-cert certificate expired on 2026-11-30"
    ]
    (warning,) = warnings_for(loaded(60, ("ember.example.com",)), "ember.example.com", now)
    assert "does not cover *.ember.example.com" in warning


def test_a_renewal_halfway_done_keeps_the_served_certificate(tmp_path: Path) -> None:
    cert, key = write_pair(tmp_path, ["a.example"])
    own = OwnCertificate(cert, key)
    served = own.loaded
    assert own.reload(only_if_changed=True) is False  # nothing changed
    other = tmp_path / "other"
    other.mkdir()
    new_cert, _ = write_pair(other, ["a.example"])
    cert.write_bytes(new_cert.read_bytes())  # the certificate came, its key not yet
    assert own.reload(only_if_changed=True) is False
    assert own.loaded is served
    (other / "key.pem").rename(key)  # now the key too
    assert own.reload(only_if_changed=True) is True
    assert own.loaded.serial != served.serial
