#!/usr/bin/env bash
# Builds .venv-sglang: SGLang's HiCache storage layer and kvtier, on the CPU.
#
# SGLang's engine needs sgl-kernel, which has no CPU build, so kvtier drives
# SGLang's own storage backend factory and host memory pools, not a serving
# engine (see docs/sglang.md). SGLang pins its torch and many GPU-only
# packages, so it gets its own environment: the torch SGLang pins (it runs on
# the CPU), then SGLang without its dependencies, then only the pure-Python
# packages its cache modules import. Safe to rerun: pip keeps what is there.
# Used by scripts/test-sglang.sh (the SGLang suite) and scripts/peer-envs.sh
# (benchmarks/bench_peers.py drives SGLang's HiCacheFile backend).
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv-sglang
. .venv-sglang/bin/activate
python -m pip install --quiet --upgrade pip
# SGLang's host pools import torchvision (through its model configs); no
# torchvision build loads beside torch's CPU-only 2.13 build, so this
# environment takes the torch SGLang pins and the torchvision made for it.
python -m pip install --quiet "torch==2.14.1" "torchvision==0.29.1"
python -m pip install --quiet -e '.[test]'
python -m pip install --quiet --no-deps "sglang==0.5.23"
# Naming torch again keeps it where it is while these resolve.
python -m pip install --quiet "torch==2.14.1" \
    "transformers==5.19.0" "apache-tvm-ffi==0.1.11" "compressed-tensors==0.18.0" \
    "sentencepiece==0.2.1" gguf triton aiohttp dill ipython msgspec orjson pillow psutil \
    pybase64 "pyzmq>=25.1.2" starlette tqdm
python -c "
import sglang
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory
import kvtier.integrations.sglang
print('sglang', sglang.__version__)
"
