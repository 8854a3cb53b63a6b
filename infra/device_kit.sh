#!/usr/bin/env bash
# Pack what the GPU checks need on a GPU machine that cannot reach a package index:
# run here, where the network and a built CRIU are, then carry the kit along with the
# working tree and run bench/gpu_checks.sh there.
#
#   bash infra/device_kit.sh [--python 3.12] [--out .device-kit]
#
# The kit (git-ignored, about 40 MB):
#   wheels/       Ember's platform and worker dependencies and its build backend, binary
#                 wheels for the GPU machine's Python (x86-64 Linux); pip there installs
#                 only those it lacks (those in requirements.txt: all but pyfuse3, which
#                 has no binary wheel: lazy image roots fall back to extraction there)
#   criu/criu     the CRIU binary infra/criu.sh built, with criu/lib/ holding the shared
#                 libraries it links beyond glibc (a CUDA image rarely has libnet or
#                 libprotobuf-c), and bin/criu, a wrapper that runs it with them
#   site/pycriu   the pycriu package from .venv (plain Python)
#   native/       the worker's native helper infra/native.sh built (libprocfs_tid.so:
#                 replicas in PID namespaces need it to init CUDA)
#   MANIFEST      what is in it, for the log
#
# Needs: .venv with pycriu and a working CRIU (infra/install.sh). Torch and CUDA are not
# packed: the GPU machine's own Python has them.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON_VERSION="3.12"
KIT=".device-kit"
while (($#)); do
    case "$1" in
        --python) PYTHON_VERSION="$2"; shift 2 ;;
        --out) KIT="$2"; shift 2 ;;
        -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
        *) echo "device_kit.sh: unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
done

say() { printf '\033[1m==> %s\033[0m\n' "$*"; }
die() { printf 'device_kit.sh: %s\n' "$*" >&2; exit 1; }

VENV_PY=".venv/bin/python"
[[ -x "$VENV_PY" ]] || die "no .venv: run infra/install.sh first"
CRIU_BIN="$(command -v /usr/local/sbin/criu || PATH="$PATH:/usr/sbin" command -v criu || true)"
[[ -n "$CRIU_BIN" ]] || die "no CRIU here: run infra/install.sh (as root) first"
PYCRIU_DIR="$("$VENV_PY" -c 'import os, pycriu; print(os.path.dirname(pycriu.__file__))')" ||
    die "pycriu does not import in .venv: run infra/install.sh (as root) first"

rm -rf "$KIT"
mkdir -p "$KIT/wheels" "$KIT/criu/lib" "$KIT/bin" "$KIT/site"

say "wheels of Ember's dependencies and build backend for CPython $PYTHON_VERSION"
# The requirements come from pyproject.toml, so the kit follows its pins.
mapfile -t REQUIREMENTS < <("$VENV_PY" - <<'EOF'
import tomllib

pyproject = tomllib.load(open("pyproject.toml", "rb"))
project = pyproject["project"]
extras = project["optional-dependencies"]
build = pyproject["build-system"]["requires"]  # pip builds the editable install there
# NVML's bindings too (pure Python): bench/gpu_health_check.py reads the GPUs' health.
nvml = [r for r in extras["gpu"] if r.startswith("nvidia-ml-py")]
for requirement in build + project["dependencies"] + extras["platform"] + extras["worker"] + nvml:
    # pyfuse3 ships as source only, built against libfuse3's headers, which a GPU machine
    # may lack: without it the worker extracts image roots instead of mounting them.
    if not requirement.startswith("pyfuse3"):
        print(requirement)
EOF
)
abi="cp${PYTHON_VERSION/./}"
"$VENV_PY" -m pip download --quiet --dest "$KIT/wheels" --only-binary=:all: \
    --python-version "$PYTHON_VERSION" --implementation cp --abi "$abi" --abi abi3 \
    --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any "${REQUIREMENTS[@]}"
printf '%s\n' "${REQUIREMENTS[@]}" | grep -v '^setuptools' >"$KIT/requirements.txt"
# The LLM example's tokenizer (bench/gpu_coldstart.py), without the model hub client it
# pulls in (9 MB: files are read from disk); jinja2 comes with torch.
"$VENV_PY" -m pip download --quiet --dest "$KIT/wheels" --only-binary=:all: --no-deps \
    --python-version "$PYTHON_VERSION" --implementation cp --abi "$abi" --abi abi3 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 "tokenizers>=0.15"

say "CRIU $("$CRIU_BIN" --version | sed -n 's/^Version: *//p') and the libraries it links"
cp "$CRIU_BIN" "$KIT/criu/criu"
# Everything the binary links except the C library and the loader, which every Linux has.
ldd "$CRIU_BIN" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
        libc.so.* | ld-linux*) ;;
        *) cp -L "$lib" "$KIT/criu/lib/" ;;
    esac
done
cat >"$KIT/bin/criu" <<'EOF'
#!/bin/sh
# CRIU from the device kit, with the shared libraries packed beside it.
here="$(cd "$(dirname "$0")/.." && pwd)"
LD_LIBRARY_PATH="$here/criu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/criu/criu" "$@"
EOF
chmod +x "$KIT/bin/criu"

say "pycriu"
cp -r "$PYCRIU_DIR" "$KIT/site/pycriu"
find "$KIT/site" -name __pycache__ -prune -exec rm -rf {} +

say "the worker's native helper"
bash infra/native.sh
NATIVE_LIBRARY="worker/ember_worker/native/libprocfs_tid.so"
[[ -f "$NATIVE_LIBRARY" ]] || die "$NATIVE_LIBRARY is not built (infra/native.sh said why)"
mkdir -p "$KIT/native" && cp "$NATIVE_LIBRARY" "$KIT/native/"

{
    echo "python $PYTHON_VERSION"
    echo "criu $("$KIT/bin/criu" --version | sed -n 's/^Version: *//p')"
    echo "criu libraries: $(cd "$KIT/criu/lib" && echo *)"
    echo "native: $(cd "$KIT/native" && echo *)"
    echo "wheels: $(cd "$KIT/wheels" && ls | sed 's/-py.*\|-cp.*//' | tr '\n' ' ')"
} >"$KIT/MANIFEST"
say "kit ready: $KIT ($(du -sh "$KIT" | cut -f1)); carry it and run bench/gpu_checks.sh there"
