#!/usr/bin/env bash
# The GPU checks in one run on an NVIDIA machine that cannot reach a package index,
# from the repository root, as root, with the kit infra/device_kit.sh packed beside it:
#
#   bash bench/gpu_checks.sh [--dry-run] [driver] [health] [coldstart] [snapshot] [remap] [llm] [fill]
#
# driver, health, coldstart, snapshot and remap run, in that order, when none is named: within the
# 8 minutes a run may take. llm (the engine's eager and compiled logits, tokens/s; the
# coldstart check already compares tokens and counts graphs) and fill
# (bench/restore_fill.py: does `--huge-pages` pay on this machine, which is not a
# ballooned VM?) run when named.
#
# --dry-run runs the checks' CPU dry runs instead (--device cpu), to try the kit and this
# script on a machine without a GPU (the remap check has none: it says it is skipped).
#
# 1. sets up from the kit, offline: pip installs Ember (editable) and only the
#    dependencies the machine's Python lacks; CRIU, pycriu and the worker's native
#    helper (libprocfs_tid.so) are used from the kit;
# 2. prints the kernel, `criu check` and a CRIU round trip (infra/criu/roundtrip.py), so
#    that a machine whose kernel cannot checkpoint is told apart from a GPU failure;
# 3. runs bench/gpu_driver_check.py (the driver's files a GPU replica on an image gets
#    found, and nvidia-smi run with them first on the loader's path),
#    bench/gpu_health_check.py (the worker's GPU health watch on the real NVML),
#    bench/gpu_coldstart.py (the LLM example's cold boots against restores with its CUDA
#    graphs, to the first streamed token, two model sizes: the headline figures),
#    bench/gpu_snapshot_check.py (a CUDA graph replayed after a restore),
#    bench/gpu_remap_check.py (the driver's checkpoint calls in place, with and without
#    GPU pairs) and bench/gpu_llm_check.py (the LLM engine's CUDA graphs), each under a
#    time limit, their output also written to $OUT (or a temporary folder) as logs.
#
#   EMBER_GPU_PYTHON   the Python with a CUDA build of torch (default: python3)
#   EMBER_DEVICE_KIT   the kit's folder (default: .device-kit)
#   OUT                where the logs go
#   EMBER_GPU_CHECKS_BUDGET_S  seconds for the checks (default 450, so that the run with
#                      its set-up stays under 8 minutes); a check gets what is left, at
#                      most its own limit, and one with under 30 s left is not started
#
# Exit status: 0 when every check run passes, 1 otherwise, 2 when setting up fails.
set -uo pipefail
cd "$(dirname "$0")/.."

PY="${EMBER_GPU_PYTHON:-python3}"
KIT="$(realpath -m "${EMBER_DEVICE_KIT:-.device-kit}")"
LOGS="${OUT:-$(mktemp -d)}"
SNAPSHOT_LIMIT_S=300 # the check bounds itself at 285 s
BUDGET_S="${EMBER_GPU_CHECKS_BUDGET_S:-450}"
COLDSTART_LIMIT_S=300 # its own deadline (--deadline) leaves it 20 s to stop and report
REMAP_LIMIT_S=90
LLM_LIMIT_S=280
FILL_LIMIT_S=90
DRIVER_LIMIT_S=60
HEALTH_LIMIT_S=60

dry_run=0
checks=()
for arg in "$@"; do
    case "$arg" in
        --dry-run) dry_run=1 ;;
        -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
        *) checks+=("$arg") ;;
    esac
done
((${#checks[@]})) || checks=(driver health coldstart snapshot remap)
for name in "${checks[@]}"; do
    case "$name" in
        driver | health | coldstart | snapshot | remap | llm | fill) ;;
        *)
            echo "gpu_checks.sh: unknown check: $name (driver, health, coldstart, snapshot, remap, llm, fill)" >&2
            exit 2
            ;;
    esac
done
# On a machine without an NVIDIA GPU only the dry runs make sense.
if ((!dry_run)) && ! command -v nvidia-smi >/dev/null; then
    echo "gpu_checks.sh: skipped: no NVIDIA GPU here (nvidia-smi is missing); --dry-run tries the checks on the CPU"
    exit 0
fi

say() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }
die() { printf 'gpu_checks.sh: %s\n' "$*" >&2; exit 2; }

say "setting up from the kit ($KIT)"
[[ -f "$KIT/MANIFEST" ]] || die "no kit at $KIT: run infra/device_kit.sh where the network is"
cat "$KIT/MANIFEST"
kit_python="$(sed -n 's/^python //p' "$KIT/MANIFEST")"
here_python="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" ||
    die "$PY does not run"
[[ "$kit_python" == "$here_python" ]] ||
    die "the kit is for Python $kit_python, $PY is $here_python: infra/device_kit.sh --python $here_python"
# Editable, so that the checks run this working tree (the build backend comes from the
# kit too); the machine's own packages are kept where they fit. A system Python marked
# externally managed is installed into all the same: the machine is a scratch one.
# The kit's requirements (the platform's and worker's, less pyfuse3), then Ember without
# resolving its extras again and the tokenizer the LLM example's replicas load.
export PIP_BREAK_SYSTEM_PACKAGES=1
"$PY" -m pip install --quiet --no-index --find-links "$KIT/wheels" -r "$KIT/requirements.txt" &&
    "$PY" -m pip install --quiet --no-index --find-links "$KIT/wheels" --no-deps -e . tokenizers ||
    die "pip could not install Ember from the kit"
site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
rm -rf "$site/pycriu" && cp -r "$KIT/site/pycriu" "$site/pycriu" || die "cannot install pycriu"
export EMBER_CRIU_BINARY="$KIT/bin/criu" # the worker's CRIU, whatever the system has
# The library replicas in PID namespaces preload (the kit's, built where the compiler is).
cp "$KIT/native/"*.so worker/ember_worker/native/ || die "the kit has no native/ helper"

say "the machine"
uname -r
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null ||
    echo "nvidia-smi: not available"
"$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)' \
    2>/dev/null || echo "torch: not importable (both checks need it)"
"$PY" -c 'import cuda.bindings; print("cuda-bindings", cuda.bindings.__version__)' \
    2>/dev/null || echo "cuda-bindings: not importable (the snapshot check needs it)"
criu_at="$EMBER_CRIU_BINARY"
echo "criu: $criu_at ($("$criu_at" --version | sed -n 's/^Version: *//p'))"
if [[ " ${checks[*]} " == *" snapshot "* ]]; then
    say "criu check"
    "$criu_at" check 2>&1 | tail -n 20
    "$criu_at" check --feature uffd-noncoop >/dev/null 2>&1 &&
        echo "lazy restores: possible" || echo "lazy restores: not possible"
    say "a CRIU round trip through pycriu"
    "$PY" infra/criu/roundtrip.py "$criu_at" 2>&1 | tail -n 30
fi

status=0
run_check() { # name limit script [argument ...]
    local name="$1" limit="$2" script="$3" left=$((BUDGET_S - SECONDS))
    shift 3
    ((left < limit)) && limit="$left"
    if ((limit < 30)); then
        echo "$script: not started, $left s of the run's $BUDGET_S s left"
        status=1
        return
    fi
    say "$script $* (at most $limit s)"
    PYTHONUNBUFFERED=1 timeout --kill-after=10 "$limit" "$PY" "$script" "$@" 2>&1 |
        tee "$LOGS/$name.log"
    local rc="${PIPESTATUS[0]}"
    echo "$script: exit status $rc"
    ((rc == 0)) || status=1
}
for name in "${checks[@]}"; do
    case "$name" in
        driver)
            dry=()
            ((dry_run)) && dry=(--dry-run)
            run_check gpu_driver_check "$DRIVER_LIMIT_S" bench/gpu_driver_check.py "${dry[@]}"
            ;;
        health)
            dry=()
            ((dry_run)) && dry=(--dry-run)
            run_check gpu_health_check "$HEALTH_LIMIT_S" bench/gpu_health_check.py "${dry[@]}"
            ;;
        coldstart)
            dry=()
            ((dry_run)) && dry=(--device cpu --layers 2 --models 135m)
            # One round a model: both sizes fit the budget (more: run it on its own).
            run_check gpu_coldstart "$COLDSTART_LIMIT_S" bench/gpu_coldstart.py \
                --deadline $((COLDSTART_LIMIT_S - 20)) --rounds 1 "${dry[@]}"
            ;;
        snapshot)
            dry=()
            ((dry_run)) && dry=(--device cpu)
            run_check gpu_snapshot_check "$SNAPSHOT_LIMIT_S" bench/gpu_snapshot_check.py "${dry[@]}"
            ;;
        remap) run_check gpu_remap_check "$REMAP_LIMIT_S" bench/gpu_remap_check.py ;;
        llm)
            dry=()
            ((dry_run)) && dry=(--device cpu --layers 2)
            run_check gpu_llm_check "$LLM_LIMIT_S" bench/gpu_llm_check.py "${dry[@]}"
            ;;
        fill) run_check restore_fill "$FILL_LIMIT_S" bench/restore_fill.py --rounds 4 --gap 2 ;;
    esac
done
say "logs in $LOGS; $( ((status == 0)) && echo "every check passed" || echo "a check failed")"
exit "$status"
