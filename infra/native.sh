#!/usr/bin/env bash
# Build the worker's native helper: libprocfs_tid.so, which replicas in their own PID
# namespace preload so that /proc paths naming their threads resolve (CUDA's cuInit
# needs that; see worker/ember_worker/native/procfs_tid.c). Quick when it is built;
# installs a C compiler first where none is and this runs as root. Never fails: without
# it, replicas run as before, and the worker says that GPU replicas cannot init CUDA.
set -uo pipefail
cd "$(dirname "$0")/.."

say() { printf '\033[1m==> %s\033[0m\n' "$*"; }
source_file="worker/ember_worker/native/procfs_tid.c"
library="worker/ember_worker/native/libprocfs_tid.so"

if [[ -f "$library" && "$library" -nt "$source_file" ]]; then
    exit 0
fi
if ! command -v cc >/dev/null; then
    if [[ "$(id -u)" != 0 ]]; then
        echo "    no C compiler, and not root to install one: $library is not built" >&2
        exit 0
    fi
    say "installing a C compiler (gcc) for the worker's native helper"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc libc6-dev ||
        { echo "    gcc could not be installed: $library is not built" >&2; exit 0; }
fi
say "building the worker's native helper ($library)"
cc -O2 -Wall -Wno-format-truncation -shared -fPIC -o "$library.tmp" "$source_file" -ldl &&
    mv "$library.tmp" "$library" ||
    { rm -f "$library.tmp"; echo "    the build failed: $library is not built" >&2; }
exit 0
