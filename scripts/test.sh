#!/usr/bin/env bash
# kvtier's whole test run: lint, types, the fast suite, the example tier
# package, then the vLLM end-to-end suite and the SGLang suite, each in its own
# environment. The peers' environments (.venv-lmcache, .venv-aibrix,
# .venv-sglang: scripts/peer-envs.sh) are built before the fast suite, whose
# benchmark tests drive the peers' storage layers.
#
# Creates .venv-test with kvtier and every extra (its own environment: the
# README's .venv stays a plain install). The tests start (and stop) the
# servers they need on loopback: redis-server (installed here from Debian's
# packages when missing), moto's S3 server, mooncake_master (from the
# mooncake extra; Debian's libibverbs1 installed here when missing), kvtier
# peer nodes.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv-test
. .venv-test/bin/activate
python -m pip install --quiet --upgrade pip
# torch's CPU build first, so that the transformers extra keeps it.
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e '.[test,docs,all]' \
    -e tests/plugins/kvtier_testplugin -e examples/acme-kvtier

if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends redis-server
    # The tests start their own servers; leave no system service behind.
    $SUDO service redis-server stop >/dev/null 2>&1 || true
fi
# Mooncake's wheel links libibverbs even for TCP; its tests start mooncake_master.
if ! dpkg -s libibverbs1 >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends libibverbs1
fi
# mkdocs-material prints a notice about a future mkdocs at every build.
export NO_MKDOCS_2_WARNING=1

ruff check src tests benchmarks examples
ruff format --check src tests benchmarks examples
mypy
# The package's layers (pyproject.toml [tool.importlinter]): no import circle.
lint-imports
mypy examples/acme-kvtier/src examples/acme-kvtier/tests
mypy benchmarks/*.py benchmarks/policy_lab
# The tests too, in three runs: tests/project's imports from benchmarks/ need
# it on the path; tests/integrations' modules import each other by bare name
# (no __init__.py, as pytest runs them); the test plugin is a package of its own.
MYPYPATH=benchmarks mypy --explicit-package-bases --exclude 'tests/(plugins|integrations)/' tests
MYPYPATH=tests/integrations mypy --explicit-package-bases tests/integrations/*.py
mypy --explicit-package-bases tests/plugins
# The peers' environments, for benchmarks/bench_peers.py's drivers, which the
# fast suite runs in their quick mode (tests/project/test_benchmarks.py): here none of
# them may be missing.
deactivate
./scripts/peer-envs.sh
. .venv-test/bin/activate
export KVTIER_REQUIRE_PEER_ENVS=1
# The vLLM and SGLang suites (tests/integrations) need their own environments:
# they run below, not here.
pytest -q -m "not slow" --ignore=tests/integrations
pytest -q examples/acme-kvtier/tests
# The trace simulator end to end, on a small generated trace.
kvtier simulate --chat-seed 1 --limit 800 -p lru -p leaf-lru -c 5% -c 20% --secondary 30% --json >/dev/null
deactivate

./scripts/test-vllm.sh
./scripts/test-sglang.sh
