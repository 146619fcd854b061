#!/usr/bin/env bash
# Wheels of kvtier's core dependencies for a machine without a package index:
# CPython 3.12 on x86_64 Linux that brings its own torch and transformers.
#
# Reads the dependencies from pyproject.toml, downloads them and everything
# they need into device-wheels/ (ignored by git) with the requirements file
# beside them, and prints the bundle's size. On that machine, from a checkout
# holding device-wheels/, scripts/device-check.sh installs them and runs the
# check (kvtier itself runs from src/, its C extensions are optional).
#
# PYTHON picks the interpreter whose pip downloads (default python3; any
# version: the target is given explicitly below), DEST the folder.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DEST=${DEST:-device-wheels}

mkdir -p "$DEST"
"$PYTHON" - "$DEST/requirements.txt" <<'EOF'
import sys
import tomllib

with open("pyproject.toml", "rb") as source:
    dependencies = tomllib.load(source)["project"]["dependencies"]
with open(sys.argv[1], "w") as out:
    out.write("".join(f"{requirement}\n" for requirement in dependencies))
EOF

# Binary wheels only (nothing to build there), for CPython 3.12 and the
# manylinux tags a current x86_64 image accepts.
"$PYTHON" -m pip download --quiet --disable-pip-version-check \
    --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any \
    --dest "$DEST" -r "$DEST/requirements.txt"

ls -1 "$DEST"
du -sh "$DEST"
