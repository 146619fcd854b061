#!/usr/bin/env bash
# The peers' environments for benchmarks/bench_peers.py, one each, since the
# peers pin conflicting packages: .venv-lmcache (LMCache 0.5.6),
# .venv-aibrix (AIBrix KV cache 0.8.0) and .venv-sglang (SGLang 0.5.23, built
# by scripts/sglang-env.sh, which the SGLang suite shares). Safe to rerun:
# pip keeps what is already there.
#
# LMCache and AIBrix declare CUDA-only packages as hard dependencies, so each
# installs with --no-deps, then the packages its storage layer imports.
# Torch's CPU build goes first so that nothing pulls another one.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv-lmcache
.venv-lmcache/bin/python -m pip install --quiet --upgrade pip
.venv-lmcache/bin/python -m pip install --quiet "torch==2.13.0"
.venv-lmcache/bin/python -m pip install --quiet --no-deps "lmcache==0.5.6"
.venv-lmcache/bin/python -m pip install --quiet "torch==2.13.0" \
    aiofile aiofiles blake3 aiohttp awscrt cryptography fastapi httpx "huggingface_hub>=1.5.0" \
    msgspec "numpy<=2.2.6" numba nvtx "opentelemetry-api<=1.40.0,>=1.20.0" "opentelemetry-sdk>=1.20.0" \
    "opentelemetry-exporter-otlp>=1.20.0" "opentelemetry-exporter-prometheus<=0.61b0,>=0.50b0" \
    "prometheus_client<=0.24.1,>=0.18.0" psutil py-cpuinfo pyyaml "pyzmq>=25.0.0" redis safetensors \
    "setuptools<81.0.0,>=77.0.3" "setuptools_scm>=8" sortedcontainers uvicorn httptools cachetools \
    "transformers>=5.4"
.venv-lmcache/bin/python -c "
from lmcache.v1.storage_backend.storage_manager import StorageManager
import lmcache; print('lmcache', lmcache.__version__ if hasattr(lmcache, '__version__') else '0.5.6')
"

python3 -m venv .venv-aibrix
.venv-aibrix/bin/python -m pip install --quiet --upgrade pip
.venv-aibrix/bin/python -m pip install --quiet "torch==2.13.0"
.venv-aibrix/bin/python -m pip install --quiet --no-deps "aibrix-kvcache==0.8.0"
# Its requirements also name the long-obsolete "asyncio" package, left out:
# the standard library's asyncio is the one it uses.
.venv-aibrix/bin/python -m pip install --quiet "torch==2.13.0" \
    cityhash more-itertools msgspec netifaces numpy requests tqdm "pydantic>=2.10" pyyaml \
    sortedcontainers uvloop "validators>=0.35.0" zstandard "redis==6.0.0" nvtx pyroscope-io rocksdict
.venv-aibrix/bin/python -c "
from aibrix_kvcache.l2 import connectors
print('aibrix_kvcache', 'imports')
"

./scripts/sglang-env.sh
