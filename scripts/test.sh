#!/usr/bin/env bash
# kvtier's whole test run: lint, types, the fast suite, then the slow suite.
# Creates .venv, installs kvtier with every extra, and starts nothing by hand:
# the tests start (and stop) the servers they need on loopback.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet -e '.[test]' -e tests/plugins/kvtier_testplugin
# The user guide (built by tests/test_docs.py) and the example out-of-tree tier.
python -m pip install --quiet -e '.[docs]'
python -m pip install --quiet -e examples/acme-kvtier
export NO_MKDOCS_2_WARNING=1
# Shared tiers (redis, obj): their client libraries, and Debian's redis-server
# for the tests to start on loopback.
python -m pip install --quiet -e '.[redis,obj]'
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends redis-server
    # The tests start their own servers; leave no system service behind.
    $SUDO service redis-server stop >/dev/null 2>&1 || true
fi
# torch's CPU build first, so that the transformers extra keeps it.
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e '.[test,transformers]'

ruff check src tests
ruff check examples
mypy
mypy examples/acme-kvtier/src examples/acme-kvtier/tests
# The vLLM suite needs its own environment: it runs below, not here.
pytest -q -m "not slow" --ignore=tests/integrations/test_vllm.py
pytest -q examples/acme-kvtier/tests
# The vLLM end-to-end suite, in its own environment (vLLM's pins conflict).
deactivate
./scripts/test-vllm.sh
