"""`--domain`: spelt once, as Host headers and certificates spell it (lower-case
A-labels), for the certificate, routing and the printed URLs; a value no host can have
(a port, say) is refused at once, saying why."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509

from ember.cli.main import build_parser
from ember.errors import InvalidError
from ember_platform.config import ServerConfig
from ember_platform.security.tls import ensure_tls


def _dns_sans(path: Path) -> set[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return set(ext.get_values_for_type(x509.DNSName))


def test_the_command_line_refuses_a_domain_with_a_port(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(["server", "--domain", "ember.test:9511"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "--domain" in err and "has a port: give the host name alone ('ember.test')" in err


@pytest.mark.parametrize(
    ("given", "spelt"),
    [("Ember.Test", "ember.test"), ("bücher.test", "xn--bcher-kva.test")],
)
def test_the_command_line_and_the_config_spell_the_domain_as_hosts_do(
    tmp_path: Path, given: str, spelt: str
) -> None:
    assert build_parser().parse_args(["server", "--domain", given]).domain == spelt
    assert ServerConfig(state_dir=tmp_path, domain=given).domain == spelt
    assert ServerConfig(state_dir=tmp_path).domain is None


def test_a_server_configured_from_code_refuses_a_domain_with_a_port(tmp_path: Path) -> None:
    with pytest.raises(InvalidError, match="has a port"):
        ServerConfig(state_dir=tmp_path, domain="ember.test:9511")


def test_the_certificate_names_the_domain_as_routing_compares_it(tmp_path: Path) -> None:
    files = ensure_tls(tmp_path, hosts=[], domain="Bücher.Test.")
    assert {"xn--bcher-kva.test", "*.xn--bcher-kva.test"} <= _dns_sans(files.server_cert)
    with pytest.raises(InvalidError, match="has a port"):
        ensure_tls(tmp_path, hosts=[], domain="ember.test:9511")  # no SAN *.ember.test:9511
