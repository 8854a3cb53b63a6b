"""Install a built CRIU tree's `lib/pycriu` package into the running interpreter's
site-packages (run it with the virtual environment's Python).

    .venv/bin/python pycriu_install.py CRIU_SOURCE_TREE

CRIU's own packaging for pycriu (lib/pyproject.toml) pins `protobuf<4.0` at build time,
which fights the venv's protobuf; the package is plain Python once `make lib` has
generated its protobuf modules, so it is copied as is, with a small .dist-info so that
`pip list` shows it and `pip uninstall pycriu` removes it. The one change made on the
way is for protobuf 7, below.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
import sysconfig

# protobuf 7 dropped FieldDescriptor.label (pycriu's image decoder, pb2dict.py, uses it);
# `is_repeated` replaces it. The rewrite keeps older protobuf runtimes working too.
LABEL_REPEATED = "field.label == FD.LABEL_REPEATED"
IS_REPEATED = f'(field.is_repeated if hasattr(field, "is_repeated") else {LABEL_REPEATED})'


def main() -> int:
    tree = sys.argv[1]
    src = os.path.join(tree, "lib", "pycriu")
    version_file = os.path.join(src, "version.py")
    if not os.path.exists(os.path.join(src, "rpc_pb2.py")) or not os.path.exists(version_file):
        print(f"    error: {src} has no generated modules (run make lib)", file=sys.stderr)
        return 1
    scope: dict[str, str] = {}
    with open(version_file) as f:
        exec(f.read(), scope)
    version = scope["__version__"]

    site = sysconfig.get_paths()["purelib"]
    dest = os.path.join(site, "pycriu")
    for old in [dest, *glob.glob(os.path.join(site, "pycriu-*.dist-info"))]:
        shutil.rmtree(old, ignore_errors=True)

    record = []
    for sub in ("", "images"):
        os.makedirs(os.path.join(dest, sub), exist_ok=True)
        for path in sorted(glob.glob(os.path.join(src, sub, "*.py"))):
            name = os.path.join("pycriu", sub, os.path.basename(path))
            with open(path) as f:
                text = f.read()
            if name.endswith("pb2dict.py") and LABEL_REPEATED in text:
                text = text.replace(LABEL_REPEATED, IS_REPEATED)
                print("    pycriu: pb2dict.py adapted to protobuf >= 7", file=sys.stderr)
            with open(os.path.join(site, name), "w") as f:
                f.write(text)
            record.append(f"{name},,")

    info = f"pycriu-{version}.dist-info"
    os.makedirs(os.path.join(site, info))
    files = {
        "METADATA": (
            "Metadata-Version: 2.1\nName: pycriu\n"
            f"Version: {version}\nSummary: Python bindings for CRIU\n"
            "License: GPLv2\nRequires-Dist: protobuf\n"
        ),
        "INSTALLER": "ember-infra-criu\n",
        "top_level.txt": "pycriu\n",
    }
    for name, text in files.items():
        with open(os.path.join(site, info, name), "w") as f:
            f.write(text)
        record.append(f"{info}/{name},,")
    record.append(f"{info}/RECORD,,")
    with open(os.path.join(site, info, "RECORD"), "w") as f:
        f.write("\n".join(record) + "\n")
    print(f"    pycriu {version} -> {dest}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
