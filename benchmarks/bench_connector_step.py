"""kvtier's scheduler-side connector time per step, against vLLM's own scheduler step.

vLLM's real ``Scheduler`` with ``KVTierConnector`` (a tiny local Llama, no
workers) is driven as an engine core drives it, the runner's and kvtier
worker's reports made up (every copy done). The batch stays at ``--running``
requests: each decodes about ``--decode`` tokens and ends, and a new one comes
whose prompt shares three chunks out of a pool, so kvtier's CPU tier answers
with hits and stores. vLLM's own prefix cache is off unless
``--vllm-prefix-caching``, so every prompt reaches kvtier. Reported per step:
CPU time inside the connector's methods, the rest of the step, their ratio.

    python benchmarks/bench_connector_step.py [--running 64 256] [--steps 300]

Runs in the vLLM environment (``scripts/test-vllm.sh`` builds it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for its tests' model

BLOCK = 16
CHUNK_TOKENS = 256
#: CPU time of the calling thread: the scheduler and the connector run on one
#: thread, and time it spends descheduled for other processes counts for neither.
clock = time.thread_time_ns
#: The connector methods vLLM's scheduler calls, timed.
TIMED = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "take_events",
    "get_kv_connector_stats",
)


def build_scheduler(model: Path, running: int, prefix_caching: bool) -> tuple[Any, Any]:
    """vLLM's scheduler with kvtier's connector, for the local model, with no workers."""
    import torch
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.gc_utils import freeze_gc_heap
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    transfer = KVTransferConfig(
        kv_connector="KVTierConnector",
        kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            "kvtier": {"chunk_tokens": CHUNK_TOKENS, "cpu_bytes_to_use": "256MiB"},
            "kvtier_lookup_timeout_s": 5.0,
        },
    )
    config = EngineArgs(
        model=str(model),
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK,
        max_model_len=4096,
        max_num_seqs=running,
        max_num_batched_tokens=8192,
        enable_prefix_caching=prefix_caching,
        kv_transfer_config=transfer,
    ).create_engine_config()
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    # Room for every running request's whole sequence: nothing is preempted.
    num_blocks = running * (4096 // BLOCK) + 1
    config.cache_config.num_gpu_blocks = num_blocks  # as the engine core sets it after profiling
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
        log_stats=True,
    )
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    # As vLLM's engine core does once started: the start-up heap is out of the
    # collector's way, so that a full collection does not land in one step.
    freeze_gc_heap()
    return scheduler, get_request_block_hasher(BLOCK, hash_fn)


class Timings:
    """Nanoseconds spent in each timed connector method."""

    def __init__(self, connector: Any) -> None:
        self.ns: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        for name in TIMED:
            setattr(connector, name, self._timed(name, getattr(connector, name)))

    def _timed(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return method(*args, **kwargs)
            finally:
                self.ns[name] += clock() - start
                self.calls[name] += 1

        return timed

    def reset(self) -> None:
        self.ns.clear()
        self.calls.clear()


class Workload:
    """Prompts of four chunks: three from a pool of shared prefixes, one of their own."""

    def __init__(self, block_hasher: Any, decode: int, seed: int = 0) -> None:
        self.random = random.Random(seed)
        self.prefixes = [self._tokens(3 * CHUNK_TOKENS) for _ in range(32)]
        self.block_hasher = block_hasher
        self.decode = decode
        self.made = 0

    def _tokens(self, n: int) -> list[int]:
        return [self.random.randrange(4, 1024) for _ in range(n)]

    def request(self) -> Any:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        self.made += 1
        tokens = self.random.choice(self.prefixes) + self._tokens(CHUNK_TOKENS + 17)
        # Lengths spread around ``decode``, so that requests end and arrive every step.
        length = self.random.randint(self.decode // 2, self.decode * 3 // 2)
        params = SamplingParams(max_tokens=length, ignore_eos=True)
        return Request(f"r{self.made}", tokens, params, None, block_hasher=self.block_hasher)


def runner_output(scheduler: Any, output: Any, first: bool) -> Any:
    """What the model runner and kvtier's worker would hand back for ``output``."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    from kvtier.integrations.vllm.metadata import KVTierWorkerMetadata, StepResult

    req_ids = list(output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        # A request still inside its prompt samples nothing this step.
        sampled.append([] if request.num_computed_tokens < request.num_tokens else [7])
    meta = output.kv_connector_metadata
    report = KVTierWorkerMetadata(
        {meta.step: StepResult(True, True)}, frozenset({0}) if first else frozenset()
    )
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=report),
    )


@contextmanager
def scheduler_for(model: Path, running: int, prefix_caching: bool) -> Iterator[tuple[Any, Any]]:
    scheduler, hasher = build_scheduler(model, running, prefix_caching)
    try:
        yield scheduler, hasher
    finally:
        scheduler.shutdown()


def measure(
    model: Path, running: int, steps: int, warmup: int, decode: int, caching: bool
) -> dict[str, Any]:
    with scheduler_for(model, running, caching) as (scheduler, hasher):
        timings = Timings(scheduler.connector)
        workload = Workload(hasher, decode)
        counters = scheduler.connector._scheduler.counters
        before = vars(counters).copy()
        step_ns = 0
        scheduled = 0
        for step in range(warmup + steps):
            if step == warmup:
                timings.reset()
                before = vars(counters).copy()
                step_ns = scheduled = 0
            while len(scheduler.running) + len(scheduler.waiting) < running:
                scheduler.add_request(workload.request())
            start = clock()
            output = scheduler.schedule()
            middle = clock()
            # Building the runner's answer is not the scheduler's work: not timed.
            answer = runner_output(scheduler, output, first=step == 0)
            resumed = clock()
            scheduler.update_from_output(output, answer)
            step_ns += (middle - start) + (clock() - resumed)
            scheduled += len(output.num_scheduled_tokens)
        measured = {name: value - before[name] for name, value in vars(counters).items()}
        connector_ns = sum(timings.ns.values())
        return {
            "running": running,
            "scheduled_per_step": scheduled / steps,
            "step_ms": step_ns / steps / 1e6,
            "connector_ms": connector_ns / steps / 1e6,
            "vllm_ms": (step_ns - connector_ns) / steps / 1e6,
            "per_method_us": {n: timings.ns[n] / steps / 1e3 for n in TIMED},
            "calls_per_step": {n: timings.calls[n] / steps for n in TIMED},
            "ratio": connector_ns / (step_ns - connector_ns),
            # What the connector did over the measured steps.
            "lookups": measured["lookups"],
            "hit_tokens": measured["hit_tokens"],
            "chunks_loaded": measured["chunks_loaded"],
            "chunks_stored": measured["chunks_stored"],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=300, help="measured steps per size")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--decode", type=int, default=64, help="tokens each request decodes")
    parser.add_argument("--vllm-prefix-caching", action="store_true")
    parser.add_argument("--quick", action="store_true", help="8 requests, a few steps (tests)")
    parser.add_argument("--json", action="store_true", help="one JSON line per batch size")
    args = parser.parse_args()
    if args.quick:
        args.running, args.steps, args.warmup, args.decode = [8], 20, 40, 8
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from tests.integrations.vllm_engine import make_model

    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "tiny-llama")
        for running in args.running:
            r = measure(
                model, running, args.steps, args.warmup, args.decode, args.vllm_prefix_caching
            )
            if args.json:
                print(json.dumps(r))
                continue
            print(
                f"running={r['running']:4d}  scheduled/step={r['scheduled_per_step']:.0f}  "
                f"vLLM step {r['vllm_ms']:.3f} ms  kvtier connector {r['connector_ms']:.3f} ms  "
                f"ratio {r['ratio']:.3f}  (over {args.steps} steps: {r['lookups']} lookups, "
                f"{r['hit_tokens']} hit tokens, {r['chunks_loaded']} chunks loaded, "
                f"{r['chunks_stored']} stored)"
            )
            for name in TIMED:
                print(
                    f"    {name:28s} {r['per_method_us'][name]:9.1f} us/step"
                    f"  {r['calls_per_step'][name]:7.2f} calls/step"
                )


if __name__ == "__main__":
    main()
