"""A certificate of the operator's (`--tls-cert`, `--tls-key`: from Let's Encrypt or a
company CA, for the `--domain` names), served beside the platform's own.

A caller whose TLS handshake asks for a name the certificate covers (SNI) gets it; every
other connection (an IP address, `localhost`, another name) gets the certificate the
platform's own CA issued, so the local worker, its replicas and the machine's `ember`
command work as before. A renewed certificate is picked up without a restart: on SIGHUP,
and when either file changes (checked each minute); one that does not load (its key
still the old one, halfway through a renewal) leaves the served one in place.
"""

from __future__ import annotations

import datetime as dt
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509

from ember.errors import ConfigError

log = logging.getLogger("ember.platform")

CHECK_SECONDS = 60.0  # how often the files are looked at for a renewal
EXPIRY_WARNING = dt.timedelta(days=14)


@dataclass(frozen=True)
class LoadedCertificate:
    context: ssl.SSLContext
    names: tuple[str, ...]  # its DNS names, lower case ("*.example.com" for a wildcard)
    not_after: dt.datetime
    serial: int


def covers(names: tuple[str, ...], server_name: str | None) -> bool:
    """Whether a certificate for `names` matches `server_name` (RFC 6125: a wildcard
    stands for one whole left-most label)."""
    if not server_name:
        return False
    wanted = server_name.lower().rstrip(".")
    for name in names:
        if name == wanted:
            return True
        if name.startswith("*."):
            label, _, rest = wanted.partition(".")
            if label and rest == name[2:]:
                return True
    return False


def load_certificate(cert: Path, key: Path) -> LoadedCertificate:
    """The chain and key as a server context, with what callers will check; ConfigError
    naming the problem if they cannot be served."""
    # OpenSSL's own errors name neither the file nor what is in it: checked first here.
    for option, path in (("--tls-cert", cert), ("--tls-key", key)):
        if not path.is_file():
            raise ConfigError(f"{option} {path}: no such file")
    try:
        leaf = x509.load_pem_x509_certificate(cert.read_bytes())  # the first in the chain
    except (ValueError, OSError) as exc:
        raise ConfigError(
            f"--tls-cert {cert} is not a PEM certificate (is it the key?): {exc}"
        ) from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except OSError as exc:  # ssl.SSLError too
        text = str(exc)
        if "mismatch" in text:
            reason = "the key does not belong to the certificate"
        elif "PEM" in text or "key" in text.lower():
            reason = f"--tls-key {key} is not a PEM private key (is it the certificate?)"
        else:
            reason = text
        raise ConfigError(
            f"cannot serve --tls-cert {cert} with --tls-key {key}: {reason}"
        ) from None
    try:
        alternative = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName)
        names = tuple(n.lower() for n in alternative.value.get_values_for_type(x509.DNSName))
    except x509.ExtensionNotFound:
        names = ()
    if not names:
        raise ConfigError(f"--tls-cert {cert} names no DNS name (subjectAltName) to serve")
    return LoadedCertificate(context, names, leaf.not_valid_after_utc, leaf.serial_number)


def warnings_for(loaded: LoadedCertificate, domain: str | None, now: dt.datetime) -> list[str]:
    """What an operator should hear about the certificate at start and after a reload."""
    found = []
    if loaded.not_after <= now:
        found.append(f"the --tls-cert certificate expired on {loaded.not_after:%Y-%m-%d}")
    elif loaded.not_after - now < EXPIRY_WARNING:
        found.append(f"the --tls-cert certificate expires on {loaded.not_after:%Y-%m-%d}")
    if domain and not covers(loaded.names, f"x.{domain}"):
        found.append(
            f"the --tls-cert certificate does not cover *.{domain}, so endpoints' own host "
            "names get the platform's certificate instead"
        )
    return found


class OwnCertificate:
    """The operator's certificate, chosen per handshake by the name asked for."""

    def __init__(self, cert: Path, key: Path, domain: str | None = None) -> None:
        self.cert = cert
        self.key = key
        self.domain = domain
        self.loaded = load_certificate(cert, key)
        self._stamp = self._file_stamp()

    def attach(self, default: ssl.SSLContext) -> None:
        """Serve it from `default`'s handshakes that ask for one of its names."""
        default.sni_callback = self._choose

    def _choose(self, connection: ssl.SSLObject, server_name: str | None, _: Any) -> None:
        if covers(self.loaded.names, server_name):
            connection.context = self.loaded.context

    def describe(self) -> str:
        names = ", ".join(self.loaded.names)
        return f"{names} (until {self.loaded.not_after:%Y-%m-%d})"

    def _file_stamp(self) -> tuple[tuple[int, int], ...]:
        stamps = []
        for path in (self.cert, self.key):
            try:
                stat = path.stat()
                stamps.append((stat.st_mtime_ns, stat.st_size))
            except OSError:
                stamps.append((0, 0))
        return tuple(stamps)

    def reload(self, *, only_if_changed: bool) -> bool:
        """Load the files again (if they changed, when asked); True if a new certificate
        is served from now on."""
        stamp = self._file_stamp()
        if only_if_changed and stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            loaded = load_certificate(self.cert, self.key)
        except (ConfigError, OSError, ValueError) as exc:
            log.warning("kept the certificate served until now: %s", exc)
            return False
        self.loaded = loaded
        log.warning("now serving the renewed certificate for %s", self.describe())
        for warning in warnings_for(loaded, self.domain, dt.datetime.now(dt.UTC)):
            log.warning("%s", warning)
        return True
