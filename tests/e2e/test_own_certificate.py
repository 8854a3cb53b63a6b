"""`ember server --tls-cert/--tls-key`: the operator's certificate for callers who ask for
its names (SNI), the platform's own for everyone else, and a renewal served without a
restart."""

from __future__ import annotations

import datetime as dt
import json
import signal
import socket
import ssl
import subprocess
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from harness import EMBER, Platform, running_platform, wait_for

DOMAIN = "ember.test"


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def make_ca(folder: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("test operator CA"))
        .issuer_name(_name("test operator CA"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    (folder / "operator-ca.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def issue(
    folder: Path, ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey], names: list[str]
) -> int:
    """A leaf for `names` into fullchain.pem and privkey.pem (as certbot lays them out);
    its serial number."""
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    serial = x509.random_serial_number()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(names[0]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=30))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.PrivateFormat.PKCS8
    key_bytes = key.private_bytes(serialization.Encoding.PEM, pem, serialization.NoEncryption())
    (folder / "privkey.pem").write_bytes(key_bytes)
    chain = cert.public_bytes(serialization.Encoding.PEM)
    (folder / "fullchain.pem").write_bytes(chain + ca_cert.public_bytes(serialization.Encoding.PEM))
    return serial


def served_serial(platform: Platform, server_name: str) -> int:
    """The serial of the certificate the platform shows a handshake for `server_name`."""
    port = int(platform.url.rsplit(":", 1)[1])
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=server_name) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def curl(platform: Platform, ca: Path, host: str, path: str) -> subprocess.CompletedProcess[str]:
    port = platform.url.rsplit(":", 1)[1]
    command = ["curl", "-sS", "--cacert", str(ca), "--resolve", f"{host}:{port}:127.0.0.1"]
    command += ["-H", f"Authorization: Bearer {platform.token}", "--json", '{"text": "hi"}']
    return subprocess.run(
        [*command, f"https://{host}:{port}{path}"], capture_output=True, text=True, timeout=60
    )


def test_callers_asking_for_its_names_get_the_operators_certificate_and_its_renewal(
    tmp_path: Path, apps_dir: Path
) -> None:
    ca = make_ca(tmp_path)
    first = issue(tmp_path, ca, [DOMAIN, f"*.{DOMAIN}"])
    extra = (
        "--domain",
        DOMAIN,
        "--tls-cert",
        str(tmp_path / "fullchain.pem"),
        "--tls-key",
        str(tmp_path / "privkey.pem"),
        "--public-url",
        f"https://{DOMAIN}",  # as behind a load balancer on port 443
    )
    with running_platform(tmp_path / "p", extra=extra) as platform:
        assert any(f"your certificate: {DOMAIN}, *.{DOMAIN}" in line for line in platform.output)
        assert any(f"public URL: https://{DOMAIN}" in line for line in platform.output)
        urls = platform.deploy(apps_dir / "basic.py", "basic")
        assert urls["basic--echo"] == f"https://basic--echo.{DOMAIN}/"
        # An endpoint's own host name, verified against the operator's CA alone.
        answer = curl(platform, tmp_path / "operator-ca.pem", f"basic--echo.{DOMAIN}", "/")
        assert answer.returncode == 0, answer.stderr
        assert json.loads(answer.stdout)["text"] == "hi"
        assert served_serial(platform, f"basic--echo.{DOMAIN}") == first
        assert served_serial(platform, DOMAIN) == first
        # Everyone else (an IP address, another name) gets the platform's own, as before:
        # the machine's CLI and the local worker still work.
        own = served_serial(platform, "other.example")
        assert own != first
        with platform.client() as client:
            assert client.post("/basic--echo/", json={"text": "hi"}).json()["text"] == "hi"
        # A renewal: new files in place, then SIGHUP (certbot's deploy hook would send it).
        second = issue(tmp_path, ca, [DOMAIN, f"*.{DOMAIN}"])
        assert platform.process is not None
        platform.process.send_signal(signal.SIGHUP)
        wait_for(lambda: served_serial(platform, DOMAIN) == second, 15)
        assert served_serial(platform, "other.example") == own
        assert any("now serving the renewed certificate" in line for line in platform.output)


def test_a_key_that_is_not_the_certificates_is_refused_at_start(tmp_path: Path) -> None:
    ca = make_ca(tmp_path)
    issue(tmp_path, ca, [DOMAIN])
    (tmp_path / "fullchain.pem").rename(tmp_path / "first.pem")
    issue(tmp_path, ca, [DOMAIN])  # another key
    command = [*EMBER, "server", "--state-dir", str(tmp_path / "s"), "--port", "0"]
    command += [
        "--tls-cert",
        str(tmp_path / "first.pem"),
        "--tls-key",
        str(tmp_path / "privkey.pem"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "the key does not belong to the certificate" in result.stderr
    alone = subprocess.run(
        [*EMBER, "server", "--tls-cert", str(tmp_path / "first.pem")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert alone.returncode == 2 and "go together" in alone.stderr
