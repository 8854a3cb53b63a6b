#!/usr/bin/env bash
# uPlot, the dashboard's charting library (MIT), from the npm registry into the folder the
# control plane serves it from (git ignores it): pinned, and checked against the checksum
# below before anything is unpacked. Without it the dashboard still works, without plots,
# and says to run this. Quick when the pinned version is there already.
set -euo pipefail
cd "$(dirname "$0")/.."

version="1.6.32"
integrity="sha512-KIMVnG68zvu5XXUbC4LQEPnhwOxBuLyW1AHtpm6IKTXImkbLgkMy+jabjLgSLMasNuGGzQm/ep3tOkyTxpiQIw=="
target="platform/ember_platform/http/static/vendor/uplot"

say() { printf '\033[1m==> %s\033[0m\n' "$*"; }

if [[ -f "$target/VERSION" && "$(cat "$target/VERSION")" == "$version" ]]; then
    exit 0
fi
if ! command -v npm >/dev/null; then
    say "installing npm (the dashboard's charting library comes from the npm registry)"
    sudo=""
    [[ "$(id -u)" == 0 ]] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq npm
fi
say "installing uPlot $version for the dashboard's plots"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "uplot@$version" >/dev/null)
archive="$work/uplot-$version.tgz"
got="$(python3 -c 'import base64, hashlib, sys
print("sha512-" + base64.b64encode(hashlib.sha512(open(sys.argv[1], "rb").read()).digest()).decode())' "$archive")"
if [[ "$got" != "$integrity" ]]; then
    echo "uPlot $version: the package's checksum is $got, not the pinned $integrity" >&2
    exit 1
fi
tar -xzf "$archive" -C "$work" package/dist/uPlot.iife.min.js package/dist/uPlot.min.css package/LICENSE
mkdir -p "$target"
cp "$work/package/dist/uPlot.iife.min.js" "$work/package/dist/uPlot.min.css" "$work/package/LICENSE" "$target/"
echo "$version" >"$target/VERSION"
