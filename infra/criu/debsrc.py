"""Fetch a Debian source package from the machine's own Debian mirror.

Used by infra/criu.sh to get CRIU's source from a newer Debian release than the machine
runs (bookworm's CRIU cannot handle newer kernels' vDSO). Standard library only.

    python debsrc.py --suite trixie --package criu --dest DIR

The mirror is read from the machine's apt sources (sources.list, sources.list.d/*.list
and deb822 *.sources): the entries for the machine's own codename with the `main`
component, in apt's order. For each, the suite's InRelease is fetched and its signature
checked with gpgv against the entry's Signed-By keyring (or Debian's archive keyring),
which also tells a Debian archive from a third-party repository that happens to use the
same suite name. From the signed Release file comes the SHA-256 of the source index;
from the index, the package's files and their SHA-256 sums. Every download is checked.

The original tarball is required; the .dsc and the Debian tarball are fetched when the
mirror has them. Prints one line on stdout: `VERSION<TAB>ORIG<TAB>DEBIAN` (DEBIAN may
be empty). Progress and errors go to stderr; the exit status is non-zero on failure.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import io
import lzma
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

DEFAULT_KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
TIMEOUT = 60


class FetchError(Exception):
    pass


@dataclass
class AptSource:
    uri: str
    suites: list[str]
    components: list[str]
    signed_by: str | None
    origin: str


def log(message: str) -> None:
    print(f"    {message}", file=sys.stderr, flush=True)


def codename() -> str:
    try:
        with open("/etc/os-release") as f:
            for line in f:
                key, _, value = line.strip().partition("=")
                if key == "VERSION_CODENAME" and value:
                    return value.strip("\"'")
    except OSError:
        pass
    return "bookworm"


def _one_line_sources(path: str) -> list[AptSource]:
    out = []
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError:
        return out
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        options: dict[str, str] = {}
        m = re.match(r"^(deb|deb-src)\s+\[([^\]]*)\]\s+(.*)$", line)
        if m:
            for opt in m.group(2).split():
                key, _, value = opt.partition("=")
                options[key.lower()] = value
            rest = m.group(3).split()
        else:
            words = line.split()
            if words[0] not in ("deb", "deb-src"):
                continue
            rest = words[1:]
        if len(rest) < 2:
            continue
        out.append(
            AptSource(
                uri=rest[0],
                suites=[rest[1]],
                components=rest[2:],
                signed_by=options.get("signed-by"),
                origin=path,
            )
        )
    return out


def _deb822_sources(path: str) -> list[AptSource]:
    out = []
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return out
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        key = None
        for raw in stanza.splitlines():
            if raw.startswith("#"):
                continue
            if raw[:1] in (" ", "\t") and key:
                fields[key] += "\n" + raw.strip()
                continue
            key, sep, value = raw.partition(":")
            if not sep:
                key = None
                continue
            key = key.strip().lower()
            fields[key] = value.strip()
        if fields.get("enabled", "yes").lower() == "no":
            continue
        if not {"deb", "deb-src"} & set(fields.get("types", "").split()):
            continue
        signed_by = fields.get("signed-by", "").strip()
        # Signed-By may hold an inline key block instead of a path; use the default then.
        if not signed_by or "\n" in signed_by or signed_by.startswith("-----"):
            signed_by = None
        for uri in fields.get("uris", "").split():
            out.append(
                AptSource(
                    uri=uri,
                    suites=fields.get("suites", "").split(),
                    components=fields.get("components", "").split(),
                    signed_by=signed_by,
                    origin=path,
                )
            )
    return out


def apt_sources() -> list[AptSource]:
    """Every apt source entry, in the order apt reads them."""
    out = _one_line_sources("/etc/apt/sources.list")
    for path in sorted(glob.glob("/etc/apt/sources.list.d/*")):
        if path.endswith(".list"):
            out += _one_line_sources(path)
        elif path.endswith(".sources"):
            out += _deb822_sources(path)
    return out


def mirror_candidates(own_codename: str) -> list[AptSource]:
    seen = set()
    out = []
    for src in apt_sources():
        if own_codename not in src.suites or "main" not in src.components:
            continue
        if not src.uri.startswith(("http://", "https://")):
            continue
        uri = src.uri.rstrip("/")
        if uri in seen:
            continue
        seen.add(uri)
        src.uri = uri
        out.append(src)
    return out


def download(url: str, attempts: int = 3) -> bytes:
    last: Exception | None = None
    for attempt in range(attempts):
        try:
            req = urllib.request.Request(url, headers={"User-Agent": "ember-install"})
            with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:
                return resp.read()
        except urllib.error.HTTPError as e:
            if e.code == 404:
                raise FetchError(f"{url}: not found (404)") from e
            last = e
        except (urllib.error.URLError, OSError) as e:
            last = e
        time.sleep(1 + attempt)
    raise FetchError(f"{url}: {last}")


def verify_inrelease(data: bytes, keyring: str) -> bytes:
    """Check an InRelease file's signature with gpgv; return the signed text."""
    if not os.path.exists(keyring):
        raise FetchError(f"keyring {keyring} not found, cannot check the index signature")
    with tempfile.TemporaryDirectory(prefix="ember-debsrc-") as tmp:
        signed = os.path.join(tmp, "InRelease")
        plain = os.path.join(tmp, "Release")
        with open(signed, "wb") as f:
            f.write(data)
        try:
            proc = subprocess.run(
                ["gpgv", "--status-fd", "1", "--keyring", keyring, "--output", plain, signed],
                capture_output=True,
                text=True,
                timeout=60,
            )
        except FileNotFoundError as e:
            raise FetchError("gpgv not found, cannot check the index signature") from e
        status = proc.stdout.splitlines()
        good = [s for s in status if s.startswith("[GNUPG:] GOODSIG")]
        # Release files are signed by several keys; an older keyring may lack some of
        # them (ERRSIG with code 9: no public key). One good signature and no bad one
        # is enough.
        bad = [
            s
            for s in status
            if s.startswith("[GNUPG:] BADSIG")
            or (s.startswith("[GNUPG:] ERRSIG") and s.split()[7:8] != ["9"])
        ]
        if not good or bad or not os.path.exists(plain):
            detail = proc.stderr.strip().splitlines()[-1:] or ["no good signature"]
            raise FetchError(f"InRelease signature check failed: {detail[0]}")
        with open(plain, "rb") as f:
            return f.read()


def parse_release_sha256(release: str) -> dict[str, tuple[str, int]]:
    out: dict[str, tuple[str, int]] = {}
    in_section = False
    for line in release.splitlines():
        if not line.startswith(" "):
            in_section = line.strip() == "SHA256:"
            continue
        if in_section:
            parts = line.split()
            if len(parts) == 3:
                out[parts[2]] = (parts[0], int(parts[1]))
    return out


def release_field(release: str, name: str) -> str | None:
    for line in release.splitlines():
        key, sep, value = line.partition(":")
        if sep and key == name:
            return value.strip()
    return None


def iter_stanzas(stream: io.TextIOBase):
    lines: list[str] = []
    for line in stream:
        if line.strip():
            lines.append(line.rstrip("\n"))
        elif lines:
            yield lines
            lines = []
    if lines:
        yield lines


def find_stanza(index: bytes, compression: str, package: str) -> dict[str, str] | None:
    data = lzma.decompress(index) if compression == "xz" else gzip.decompress(index)
    text = io.StringIO(data.decode("utf-8", "replace"))
    found = None
    for lines in iter_stanzas(text):
        if lines[0] != f"Package: {package}":
            continue
        fields: dict[str, str] = {}
        key = None
        for line in lines:
            if line[:1] in (" ", "\t") and key:
                fields[key] += "\n" + line.strip()
            else:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        found = fields  # the last stanza of the package wins, as in apt's index
    return found


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_file(url: str, dest: str, sha256: str, size: int) -> None:
    if os.path.exists(dest) and os.path.getsize(dest) == size and sha256_of(dest) == sha256:
        log(f"{os.path.basename(dest)}: already downloaded")
        return
    data = download(url)
    got = hashlib.sha256(data).hexdigest()
    if len(data) != size or got != sha256:
        raise FetchError(f"{url}: SHA-256 mismatch (got {got}, want {sha256})")
    tmp = dest + ".part"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, dest)
    log(f"{os.path.basename(dest)}: {size} bytes, SHA-256 verified")


def fetch_source(suite: str, package: str, dest: str) -> tuple[str, str, str]:
    own = codename()
    candidates = mirror_candidates(own)
    if not candidates:
        raise FetchError(f"no Debian mirror for '{own}' with 'main' in the apt sources")
    errors = []
    for src in candidates:
        # gpgv reads binary keyrings only; apt also takes armored .asc files, so Debian's
        # own keyring is the fallback.
        keyrings = list(dict.fromkeys([src.signed_by or DEFAULT_KEYRING, DEFAULT_KEYRING]))
        try:
            inrelease = download(f"{src.uri}/dists/{suite}/InRelease")
            for keyring in keyrings:
                try:
                    signed = verify_inrelease(inrelease, keyring)
                    break
                except FetchError:
                    if keyring == keyrings[-1]:
                        raise
            release = signed.decode("utf-8", "replace")
            if release_field(release, "Codename") != suite:
                raise FetchError(f"the Release file is not for {suite}")
        except FetchError as e:
            errors.append(f"{src.uri} ({os.path.basename(src.origin)}): {e}")
            continue
        log(f"mirror {src.uri} (from {src.origin}), {suite} index signature verified")
        return _fetch_from(src.uri, release, suite, package, dest)
    raise FetchError("no usable mirror: " + "; ".join(errors))


def _fetch_from(uri: str, release: str, suite: str, package: str, dest: str):
    sums = parse_release_sha256(release)
    for compression in ("xz", "gz"):
        name = f"main/source/Sources.{compression}"
        if name in sums:
            break
    else:
        raise FetchError(f"the {suite} Release file lists no main/source/Sources index")
    sha, size = sums[name]
    index = download(f"{uri}/dists/{suite}/{name}")
    if len(index) != size or hashlib.sha256(index).hexdigest() != sha:
        raise FetchError(f"{name}: SHA-256 does not match the signed Release file")
    stanza = find_stanza(index, compression, package)
    if stanza is None:
        raise FetchError(f"no '{package}' source package in {suite}")
    version = stanza.get("Version", "")
    directory = stanza.get("Directory", "")
    files = []
    for line in stanza.get("Checksums-Sha256", "").splitlines():
        parts = line.split()
        if len(parts) == 3:
            files.append((parts[2], parts[0], int(parts[1])))
    if not version or not directory or not files:
        raise FetchError(f"incomplete '{package}' stanza in the {suite} index")
    log(f"{package} {version} in {suite} ({directory})")
    os.makedirs(dest, exist_ok=True)
    orig = debian = ""
    for name, sha, size in files:
        path = os.path.join(dest, name)
        required = ".orig.tar." in name
        try:
            fetch_file(f"{uri}/{directory}/{name}", path, sha, size)
        except FetchError as e:
            if required:
                raise
            log(f"{name}: skipped ({e})")
            continue
        if required:
            orig = path
        elif ".debian.tar." in name:
            debian = path
    if not orig:
        raise FetchError(f"the '{package}' stanza lists no .orig tarball")
    return version, orig, debian


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="trixie")
    parser.add_argument("--package", default="criu")
    parser.add_argument("--dest", required=True)
    parser.add_argument("--list-mirrors", action="store_true", help="print candidates, exit")
    args = parser.parse_args()
    if args.list_mirrors:
        for src in mirror_candidates(codename()):
            print(src.uri, src.origin, src.signed_by or DEFAULT_KEYRING)
        return 0
    try:
        version, orig, debian = fetch_source(args.suite, args.package, args.dest)
    except FetchError as e:
        print(f"    error: {e}", file=sys.stderr)
        return 1
    print(f"{version}\t{orig}\t{debian}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
