#!/usr/bin/env bash
# kvtier as an SGLang HiCache storage backend: the SGLang suite, in
# .venv-sglang (built by scripts/sglang-env.sh; see there why it is its own
# environment and drives SGLang's storage layer, not a serving engine).
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/sglang-env.sh
. .venv-sglang/bin/activate
pytest -q -m slow tests/integrations/test_sglang.py
