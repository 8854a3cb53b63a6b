#!/usr/bin/env bash
# Make CRIU >= 4.1 and its Python bindings (pycriu) available to ./.venv, for process
# snapshots. Run by infra/install.sh after the Python packages; runnable on its own.
#
#   bash infra/criu.sh
#
# Quick when CRIU is already there: a working `criu` (/usr/local/sbin/criu first, then
# PATH) whose version is >= 4.1, whose `criu check` passes and which pycriu in .venv
# imports is enough. A dump/restore round trip proves it once per binary, kernel and
# pycriu; the result is kept in .venv/.ember-criu-ok.
#
# Otherwise, as root: CRIU's source package from the next Debian release (bookworm's
# 3.17 cannot handle newer kernels' vDSO) is fetched from the machine's own Debian
# mirror (read from its apt sources; signature and SHA-256 checked), built with the
# build dependencies from the machine's own release, and installed: the binary to
# /usr/local/sbin/criu (a Debian /usr/sbin/criu stays as it is), pycriu into .venv.
# Our patches in infra/criu/patches/ are applied first (they make restores faster, see
# each one's header); a /usr/local/sbin/criu built with other patches is built again.
# Downloads and the build tree are kept in /var/cache/ember/criu, so a rerun (a new
# venv, say) builds nothing.
#
# Never fails the install: without root, network or a working build, it prints one
# warning that snapshots are off and why, and exits 0; replicas then cold-boot.
#
#   EMBER_CRIU=skip           do nothing
#   EMBER_CRIU_SUITE=trixie   the Debian release whose source package is built
#   EMBER_CRIU_CACHE=DIR      where sources and the build tree are kept
set -uo pipefail
cd "$(dirname "$0")/.." || exit 0

MIN_VERSION="4.1"
SUITE="${EMBER_CRIU_SUITE:-trixie}"
CACHE="${EMBER_CRIU_CACHE:-/var/cache/ember/criu}"
PREFIX_BIN="/usr/local/sbin/criu"
VENV_PY="$PWD/.venv/bin/python"
STAMP=".venv/.ember-criu-ok"
HERE="infra/criu"
PATCHES_MARK="/usr/local/share/ember/criu-patches"
BUILD_DEPS=(
    build-essential pkg-config uuid-dev libcap-dev libnl-3-dev libnet1-dev
    libprotobuf-dev libprotobuf-c-dev protobuf-compiler protobuf-c-compiler
)

say() { printf '\033[1m==> %s\033[0m\n' "$*"; }
off() {
    if [[ "${state:-}" == patches ]]; then # the CRIU there still works, unpatched
        [[ -x "$PREFIX_BIN.unpatched" ]] && mv -f "$PREFIX_BIN.unpatched" "$PREFIX_BIN"
        printf '\033[1;33mwarning: could not build CRIU with our patches (%s); keeping %s as it is (restores fill memory a page at a time).\033[0m\n' \
            "$*" "$PREFIX_BIN"
        exit 0
    fi
    printf '\033[1;33mwarning: CRIU snapshots are off (%s); replicas will cold-boot.\033[0m\n' \
        "$*"
    exit 0
}

[[ "${EMBER_CRIU:-}" == "skip" ]] && off "EMBER_CRIU=skip"
[[ -x "$VENV_PY" ]] || off "no .venv yet: run infra/install.sh"

# The criu binary to use: ours first, then whatever PATH has.
find_criu() {
    if [[ -x "$PREFIX_BIN" ]]; then
        echo "$PREFIX_BIN"
    else
        PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin" command -v criu 2>/dev/null
    fi
}

# What our patches are: an install or a build tree made with other ones is made again.
patches_id() { cat "$HERE"/patches/*.patch 2>/dev/null | sha256sum | cut -c1-16; }
PATCHES_ID="$(patches_id)"

criu_version() { "$1" --version 2>/dev/null | sed -n 's/^Version: *//p' | head -n1; }

version_ok() {
    [[ -n "$1" && "$(printf '%s\n' "$MIN_VERSION" "$1" | sort -V | head -n1)" == "$MIN_VERSION" ]]
}

pycriu_version() {
    "$VENV_PY" -c 'import pycriu, pycriu.rpc_pb2; print(pycriu.__version__)' 2>/dev/null
}

stamp_line() { # binary version pycriu-version
    echo "$1 $2 $(stat -c '%s-%Y' "$1") $(uname -r) $3"
}

# Round trip through pycriu; writes the stamp when it works, prints the log when not.
verify() {
    local bin="$1" version="$2" py_version="$3" out
    say "checking a CRIU dump and restore through pycriu"
    if out="$("$VENV_PY" "$HERE/roundtrip.py" "$bin" 2>&1)"; then
        echo "    $out"
        stamp_line "$bin" "$version" "$py_version" >"$STAMP"
        say "CRIU $version ready ($bin, pycriu $py_version)"
        return 0
    fi
    rm -f "$STAMP"
    printf '%s\n' "$out" | sed 's/^/    /'
    return 1
}

# --- fast path -------------------------------------------------------------------------
bin="$(find_criu || true)"
version=""
[[ -n "$bin" ]] && version="$(criu_version "$bin")"
if [[ -z "$bin" ]]; then
    state="missing"
elif ! version_ok "$version"; then
    state="old"
elif ! check_out="$("$bin" check 2>&1)"; then
    state="check"
elif ! py_version="$(pycriu_version)"; then
    state="pycriu"
elif [[ "$bin" == "$PREFIX_BIN" && "$(cat "$PATCHES_MARK" 2>/dev/null)" != "$PATCHES_ID" &&
    "$(id -u)" == 0 ]]; then
    state="patches"
else
    want="$(stamp_line "$bin" "$version" "$py_version")"
    if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
        say "CRIU $version ready"
        exit 0
    fi
    verify "$bin" "$version" "$py_version" && exit 0
    off "CRIU $version at $bin fails a dump/restore round trip, see above"
fi

# --- slow path: build CRIU and pycriu --------------------------------------------------
if [[ "$(id -u)" != 0 ]]; then
    case "$state" in
    missing) off "no criu binary, and installing one needs root" ;;
    old) off "criu ${version:-?} at $bin is older than $MIN_VERSION, and building one needs root" ;;
    check) off "'criu check' fails as $(id -un): CRIU needs root" ;;
    pycriu) off "pycriu is missing from .venv, and building it needs root" ;;
    esac
fi
case "$state" in
missing) say "no criu binary: building CRIU from Debian $SUITE" ;;
old)
    say "criu ${version:-?} at $bin is older than $MIN_VERSION: building CRIU from Debian $SUITE"
    ;;
check)
    say "'criu check' fails for criu $version at $bin:"
    printf '%s\n' "$check_out" | tail -n 5 | sed 's/^/    /'
    say "building CRIU from Debian $SUITE"
    ;;
pycriu) say "pycriu is missing from .venv: installing it from CRIU's source tree" ;;
patches) say "criu $version at $bin lacks the patches in $HERE/patches: building it again" ;;
esac
started=$SECONDS
mkdir -p "$CACHE" || off "cannot create $CACHE"

# pycriu needs Google's protobuf runtime in the venv.
if ! "$VENV_PY" -c 'import google.protobuf' 2>/dev/null; then
    say "installing protobuf into .venv (pycriu needs it)"
    "$VENV_PY" -m pip install --quiet 'protobuf>=4.21' || off "pip could not install protobuf"
fi

apt_install() {
    local missing=() pkg
    for pkg in "$@"; do
        dpkg-query -W -f='${db:Status-Abbrev}' "$pkg" 2>/dev/null | grep -q '^ii' ||
            missing+=("$pkg")
    done
    ((${#missing[@]})) || return 0
    say "installing build dependencies: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    for pkg in "${missing[@]}"; do
        if ! apt-cache show --no-all-versions "$pkg" >/dev/null 2>&1; then
            apt-get update -qq || return 1
            break
        fi
    done
    local install=(apt-get install -y --no-install-recommends -qq "${missing[@]}")
    "${install[@]}" >"$CACHE/apt.log" 2>&1 && return 0
    # A stale package list (files gone from the mirror): refresh once and retry.
    apt-get update -qq && "${install[@]}" >"$CACHE/apt.log" 2>&1 && return 0
    tail -n 15 "$CACHE/apt.log" | sed 's/^/    /'
    return 1
}

# A tree built earlier (a new venv, say) is reused as it is: no network, no build.
tree=""
for done_mark in "$CACHE"/criu-*/.ember-built; do
    [[ -f "$done_mark" && "$(cat "$done_mark")" == "$PATCHES_ID" ]] || continue
    candidate="$(dirname "$done_mark")"
    newest="$(printf '%s\n' "$tree" "$candidate" | sort -V | tail -n1)"
    [[ -z "$tree" || "$newest" == "$candidate" ]] && tree="$candidate"
done

# (One whose binary no longer runs, its libraries removed say, is built again.)
if [[ -n "$tree" ]] && version_ok "$(criu_version "$tree/criu/criu")"; then
    say "using the CRIU tree built earlier in $tree"
else
    # The proxy apt is told to use, if any, serves our downloads too.
    if [[ -z "${http_proxy:-}" ]]; then
        apt_proxy="$(apt-config dump 2>/dev/null |
            sed -n 's/^Acquire::http::Proxy "\(.*\)";$/\1/p' | head -n1)"
        [[ -n "$apt_proxy" && "$apt_proxy" != DIRECT ]] && export http_proxy="$apt_proxy"
    fi
    say "fetching CRIU's source package from Debian $SUITE (mirror from the apt sources)"
    fetched="$("$VENV_PY" "$HERE/debsrc.py" --suite "$SUITE" --package criu --dest "$CACHE/src")" ||
        off "could not fetch CRIU's source from Debian $SUITE, see above"
    IFS=$'\t' read -r src_version orig debian_tar <<<"$fetched"
    upstream="${src_version#*:}"
    upstream="${upstream%-*}"
    tree="$CACHE/criu-$upstream"

    apt_install "${BUILD_DEPS[@]}" || off "could not install CRIU's build dependencies"

    say "unpacking $(basename "$orig")"
    rm -rf "$tree" "$CACHE/unpack"
    { mkdir -p "$CACHE/unpack" && tar -xf "$orig" -C "$CACHE/unpack"; } ||
        off "could not unpack $orig"
    top="$(find "$CACHE/unpack" -mindepth 1 -maxdepth 1 -type d | head -n1)"
    { [[ -n "$top" ]] && mv "$top" "$tree" && rm -rf "$CACHE/unpack"; } ||
        off "unexpected layout in $orig"

    # Upstream as shipped, docs and plugins left out; no GnuTLS (TLS page server) so the
    # binary is the same whatever -dev packages the machine happens to have.
    make_args=(-C "$tree" -j"$(nproc)" NO_GNUTLS=1 PYTHON="$VENV_PY")
    build() {
        make "${make_args[@]}" criu >"$CACHE/build.log" 2>&1 &&
            make "${make_args[@]}" lib >>"$CACHE/build.log" 2>&1
    }
    # Ours first. One that no longer applies (a newer CRIU changed the code) is left
    # out with a warning: that CRIU works as shipped, only slower to restore.
    our_patches() {
        local patch
        for patch in "$HERE"/patches/*.patch; do
            [[ -f "$patch" ]] || continue
            if patch -d "$tree" -p1 -s -N --dry-run <"$patch" >/dev/null 2>&1; then
                echo "    applying $(basename "$patch")"
                patch -d "$tree" -p1 -s -N <"$patch" || return 1
            else
                printf '\033[1;33mwarning: %s does not apply to CRIU %s; left out\033[0m\n' \
                    "$(basename "$patch")" "$upstream"
            fi
        done
    }
    debian_patches() {
        tar -xf "$debian_tar" -C "$tree" || return 1
        [[ -f "$tree/debian/patches/series" ]] || return 0
        local patch
        while read -r patch _; do
            [[ -z "$patch" || "$patch" == \#* ]] && continue
            echo "    applying $patch"
            patch -d "$tree" -p1 -s -N <"$tree/debian/patches/$patch" || return 1
        done <"$tree/debian/patches/series"
    }
    our_patches || off "could not apply the patches in $HERE/patches"
    say "building CRIU $upstream (make criu lib; log in $CACHE/build.log)"
    build_started=$SECONDS
    if ! build && ! {
        [[ -n "$debian_tar" ]] && say "the upstream build failed; retrying with Debian's patches" &&
            debian_patches && build
    }; then
        tail -n 25 "$CACHE/build.log" | sed 's/^/    /'
        off "building CRIU $upstream failed, see $CACHE/build.log"
    fi
    echo "    built in $((SECONDS - build_started)) s"
    echo "$PATCHES_ID" >"$tree/.ember-built"
fi

version="$(criu_version "$tree/criu/criu")"
version_ok "$version" || off "the CRIU built in $tree reports version '${version:-?}'"

# Install our binary unless a working >= 4.1 one is already there (then only pycriu);
# one of ours built with other patches is replaced.
bin="$(find_criu || true)"
have="$([[ -n "$bin" ]] && criu_version "$bin")"
if [[ -z "$bin" ]] || ! version_ok "$have" || ! "$bin" check >/dev/null 2>&1 ||
    { [[ "$bin" == "$PREFIX_BIN" ]] && ! cmp -s "$tree/criu/criu" "$PREFIX_BIN"; }; then
    say "installing criu $version to $PREFIX_BIN"
    # Kept until the new one has passed its round trip (off() puts it back if not).
    [[ "$state" == patches ]] && cp -p "$PREFIX_BIN" "$PREFIX_BIN.unpatched"
    {
        install -D -m 0755 "$tree/criu/criu" "$PREFIX_BIN.new" &&
            mv -f "$PREFIX_BIN.new" "$PREFIX_BIN"
    } || off "could not install $PREFIX_BIN"
    bin="$PREFIX_BIN"
    have="$version"
    hash -r
fi
say "installing pycriu $version into .venv"
"$VENV_PY" "$HERE/pycriu_install.py" "$tree" || off "could not install pycriu into .venv"
py_version="$(pycriu_version)"
if [[ -z "$py_version" ]]; then
    "$VENV_PY" -c 'import pycriu, pycriu.rpc_pb2' 2>&1 | tail -n 3 | sed 's/^/    /'
    off "pycriu does not import in .venv"
fi

say "checking the kernel with 'criu check'"
if ! check_out="$("$bin" check 2>&1)"; then
    printf '%s\n' "$check_out" | sed 's/^/    /'
    off "'criu check' fails for criu $have on kernel $(uname -r)"
fi
verify "$bin" "$have" "$py_version" || off "CRIU $have fails a dump/restore round trip, see above"
rm -f "$PREFIX_BIN.unpatched"
if [[ "$bin" == "$PREFIX_BIN" ]]; then # ours, built with these patches: no rebuild next time
    { mkdir -p "$(dirname "$PATCHES_MARK")" && echo "$PATCHES_ID" >"$PATCHES_MARK"; } ||
        echo "    (could not write $PATCHES_MARK: the next run builds CRIU again)"
fi
echo "    done in $((SECONDS - started)) s"
exit 0
