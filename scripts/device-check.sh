#!/usr/bin/env bash
# scripts/device_check.py on a machine without a package index.
#
# Installs kvtier's dependencies from device-wheels/ (made beforehand by
# scripts/device-wheels.sh), then runs the check with kvtier from src/ and
# the arguments given here, e.g.:
#
#   bash scripts/device-check.sh --json device-check.json 2>&1 | tee device-check.log
#
# The wheels go into the environment; where it refuses them (an externally
# managed one, PEP 668) into device-site/ beside it; where there is no pip,
# they are unpacked there (wheels are zip files that import as they are).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=device-wheels
SITE=device-site

install() {
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-index \
        --find-links "$WHEELS" -r "$WHEELS/requirements.txt" "$@"
}

if [ ! -f "$WHEELS/requirements.txt" ]; then
    echo "no $WHEELS/requirements.txt: run scripts/device-wheels.sh where an index is reachable" >&2
    exit 2
fi
if ! install; then
    echo "installing into the environment failed; installing into $SITE/ instead" >&2
    if ! install --target "$SITE"; then
        echo "no usable pip; unpacking the wheels into $SITE/" >&2
        "$PYTHON" - "$WHEELS" "$SITE" <<'EOF'
import pathlib
import sys
import zipfile

wheels, site = map(pathlib.Path, sys.argv[1:])
for wheel in sorted(wheels.glob("*.whl")):
    zipfile.ZipFile(wheel).extractall(site)
EOF
    fi
fi
PYTHONPATH="src:$SITE${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" scripts/device_check.py "$@"
