"""kvtier as an SGLang HiCache storage backend, through SGLang's own code on the CPU.

SGLang's engine needs sgl-kernel, which has no CPU build, so these tests
drive the pieces of SGLang a storage backend meets: its dynamic backend
factory, its storage config, its MHA device and host memory pools and its
page hashes. Pages go through kvtier's CPU primary tier to real secondary
tiers (``memory``, ``fs``) and come back byte for byte.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang", reason="needs SGLang: run scripts/test-sglang.sh")

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from sglang_pages import (
    PAGE,
    attach,
    extra_config,
    host_pool,
    mla_host_pool,
    model_dir,
    page_digest,
    page_hashes,
    write_weights,
)

from kvtier.errors import ConfigError
from kvtier.integrations.sglang import KVTierHiCacheStorage
from kvtier.tiers.base import TransferJob

pytestmark = pytest.mark.slow

READER = Path(__file__).with_name("sglang_pages.py")
TOKENS = list(range(1000, 1000 + 6 * PAGE))
LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


def fs_config(root: Path, **overrides: Any) -> dict[str, Any]:
    return {
        "cpu_bytes_to_use": "64KiB",
        "secondary_tiers": [{"type": "fs", "root_dir": str(root)}],
        **overrides,
    }


def fill(pool: Any, seed: int) -> None:
    """Random KV in every page of the host pool."""
    generator = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=generator))


def indices(first_page: int, pages: int) -> torch.Tensor:
    """Host pool token indices of ``pages`` pages from page ``first_page`` on."""
    return torch.arange(first_page * PAGE, (first_page + pages) * PAGE, dtype=torch.int64)


def test_sglangs_factory_builds_the_backend_from_the_documented_extra_config(
    tmp_path: Path,
) -> None:
    pool = host_pool()
    backend = attach(pool, extra_config(fs_config(tmp_path)))
    try:
        assert isinstance(backend, KVTierHiCacheStorage)
        assert isinstance(backend, HiCacheStorage)
        layout = backend.kv.layout
        assert layout.chunk_tokens == PAGE
        assert layout.slot_bytes == pool.get_dummy_flat_data_page().numel() * 2
        assert (layout.num_layers, layout.num_kv_heads, layout.dtype) == (3, 2, "bfloat16")
        assert [tier.tier_type for tier in backend.kv.manager.tiers] == ["fs"]
    finally:
        backend.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_round_trip_through_the_zero_copy_api(tmp_path: Path, layout: str) -> None:
    pool = host_pool(layout)
    fill(pool, seed=1)
    keys = page_hashes(TOKENS)
    written = [page_digest(pool, page * PAGE) for page in range(len(keys))]
    backend = attach(pool, extra_config(fs_config(tmp_path)))
    try:
        assert backend.batch_exists(keys) == 0
        assert backend.batch_set_v1(keys, indices(0, len(keys))) == [True] * len(keys)
        assert backend.batch_exists(keys) == len(keys)
        pool.kv_buffer.zero_()
        loaded = backend.batch_get_v1(keys, indices(10, len(keys)))
        assert loaded == [True] * len(keys)
        assert [page_digest(pool, (10 + page) * PAGE) for page in range(len(keys))] == written
    finally:
        backend.close()


def test_pages_round_trip_through_the_page_api(tmp_path: Path) -> None:
    pool = host_pool()
    fill(pool, seed=2)
    keys = page_hashes(TOKENS)
    pages = [pool.get_data_page(page * PAGE).clone() for page in range(len(keys))]
    backend = attach(pool, extra_config(fs_config(tmp_path)))
    try:
        assert not backend.exists(keys[0])
        assert backend.set(keys[0], pages[0])
        assert backend.exists(keys[0])
        assert backend.batch_set(keys, pages)
        targets = [pool.get_dummy_flat_data_page() for _ in keys]
        got = backend.batch_get(keys, targets)
        for page, target, result in zip(pages, targets, got, strict=True):
            assert result is target
            assert torch.equal(target, page)
        single = backend.get(keys[3])
        assert single is not None and torch.equal(single, pages[3])
    finally:
        backend.close()


def test_only_the_leading_pages_present_count(tmp_path: Path) -> None:
    pool = host_pool()
    fill(pool, seed=3)
    keys = page_hashes(TOKENS)
    backend = attach(pool, extra_config(fs_config(tmp_path)))
    try:
        # Pages 0, 1 and 3 stored; page 2 never was.
        backend.batch_set_v1(keys[:2], indices(0, 2))
        backend.batch_set_v1(keys[3:4], indices(3, 1))
        assert backend.batch_exists(keys) == 2
        assert backend.exists(keys[3]) and not backend.exists(keys[2])
        assert backend.batch_get_v1(keys, indices(10, len(keys))) == [True, True] + [False] * 4
        got = backend.batch_get(keys)
        assert [page is not None for page in got] == [True, True] + [False] * 4
    finally:
        backend.close()


def test_pages_evicted_from_the_primary_tier_come_back_from_every_secondary_tier(
    tmp_path: Path,
) -> None:
    """A primary tier of 4 pages, 6 pages written: the first ones come back
    from the ``memory`` tier, and from ``fs`` alone once the memory tier is gone."""
    pool = host_pool()
    fill(pool, seed=4)
    keys = page_hashes(TOKENS)
    written = [page_digest(pool, page * PAGE) for page in range(len(keys))]
    page_bytes = bytes_a_page(pool)
    tiers = [
        {"type": "memory", "max_bytes": 64 * page_bytes},
        {"type": "fs", "root_dir": str(tmp_path)},
    ]
    kvtier = {"cpu_bytes_to_use": 4 * page_bytes, "secondary_tiers": tiers}
    backend = attach(pool, extra_config(kvtier))
    try:
        for page, key in enumerate(keys):
            assert backend.batch_set_v1([key], indices(page, 1)) == [True]
        backend.kv.drain()
        primary = backend.kv.manager.primary
        evicted = [k for k in backend.page_keys(keys) if not primary.is_ready(k)]
        assert len(evicted) >= 2
        memory = backend.kv.manager.tiers[0]
        loads_before = memory.stats.chunks_loaded
        pool.kv_buffer.zero_()
        assert backend.batch_get_v1(keys, indices(10, len(keys))) == [True] * len(keys)
        assert [page_digest(pool, (10 + page) * PAGE) for page in range(len(keys))] == written
        assert memory.stats.chunks_loaded >= loads_before + len(evicted)
    finally:
        backend.close()
    # A new backend on the same fs root with no memory tier: pages come from fs.
    fresh = host_pool()
    backend = attach(fresh, extra_config({**kvtier, "secondary_tiers": tiers[1:]}))
    try:
        assert backend.batch_get_v1(keys, indices(0, len(keys))) == [True] * len(keys)
        assert [page_digest(fresh, page * PAGE) for page in range(len(keys))] == written
    finally:
        backend.close()


def bytes_a_page(pool: Any) -> int:
    page = pool.get_dummy_flat_data_page()
    return int(page.numel() * page.element_size())


def pages_left_on(root: Path, seed: int) -> tuple[list[str], list[str]]:
    """The keys of ``TOKENS``' pages, written to an fs tier on ``root`` by a
    backend that closed (draining: every page is on disk), and their digests."""
    pool = host_pool()
    fill(pool, seed=seed)
    keys = page_hashes(TOKENS)
    written = [page_digest(pool, page * PAGE) for page in range(len(keys))]
    backend = attach(pool, extra_config(fs_config(root)))
    try:
        assert all(backend.batch_set_v1(keys, indices(0, len(keys))))
    finally:
        backend.close()
    return keys, written


def test_pages_promoted_in_several_jobs_each_reach_their_place_in_the_host_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read from fs promoted as jobs of two pages (``PROMOTION_JOB_BYTES``):
    each page is handed to the host pool as its job lands, where it belongs."""
    from kvtier import manager as manager_module

    keys, written = pages_left_on(tmp_path, seed=6)
    fresh = host_pool()
    monkeypatch.setattr(manager_module, "PROMOTION_JOB_BYTES", 2 * bytes_a_page(fresh))
    backend = attach(fresh, extra_config(fs_config(tmp_path)))
    try:
        tier: Any = backend.kv.manager.tiers[0]
        assert tier.wait_index(60)  # every page known at once: jobs in order
        sizes: list[int] = []
        submit = tier.submit_load

        def submit_load(job: TransferJob) -> None:
            sizes.append(len(job.keys))
            submit(job)

        monkeypatch.setattr(tier, "submit_load", submit_load)
        assert backend.batch_get_v1(keys, indices(3, len(keys))) == [True] * len(keys)
        assert [page_digest(fresh, (3 + page) * PAGE) for page in range(len(keys))] == written
    finally:
        backend.close()
    assert sizes == [2, 2, 2]


def _read_in_new_process(tmp_path: Path, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    spec_file, out_file = tmp_path / f"{name}-spec.json", tmp_path / f"{name}-out.json"
    spec_file.write_text(json.dumps(spec))
    done = subprocess.run(
        [sys.executable, str(READER), str(spec_file), str(out_file)],
        capture_output=True,
        text=True,
        timeout=600,  # a safety net for a hung process, not a performance limit
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result: dict[str, Any] = json.loads(out_file.read_text())
    return result


def test_a_new_process_finds_the_pages_on_the_same_fs_root(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    keys, written = pages_left_on(root, seed=5)
    spec = {"layout": "layer_first", "extra": extra_config(fs_config(root)), "keys": keys}
    same = _read_in_new_process(tmp_path, "same", spec)
    assert same["found"] == len(keys)
    assert same["loaded"] == [True] * len(keys)
    assert same["digests"] == written


@pytest.mark.parametrize(
    ("name", "layout", "config"),
    [
        ("page layout", "page_first", {}),
        ("model", "layer_first", {"model": model_dir("other-model")}),
        ("tp rank", "layer_first", {"tp_rank": 1, "tp_size": 2}),
    ],
)
def test_another_deployment_shares_nothing(
    tmp_path: Path, name: str, layout: str, config: dict[str, Any]
) -> None:
    root = tmp_path / "kv"
    pool = host_pool()
    fill(pool, seed=6)
    keys = page_hashes(TOKENS)
    backend = attach(pool, extra_config(fs_config(root)))
    try:
        assert all(backend.batch_set_v1(keys, indices(0, len(keys))))
    finally:
        backend.close()
    assert any(root.rglob("*")), "the pages were written to the fs root"

    other = host_pool(layout)
    backend = attach(other, extra_config(fs_config(root)), **config)
    try:
        assert backend.batch_exists(keys) == 0, name
        assert backend.batch_get_v1(keys, indices(0, len(keys))) == [False] * len(keys)
    finally:
        backend.close()
    # The same deployment again does find them: the misses above are the namespace's.
    again = attach(host_pool(), extra_config(fs_config(root)))
    try:
        assert again.batch_exists(keys) == len(keys)
    finally:
        again.close()


def test_a_kvtier_config_file_is_read(tmp_path: Path) -> None:
    config_file = tmp_path / "kvtier.yaml"
    root = tmp_path / "kv"
    config_file.write_text(
        f"cpu_bytes_to_use: 64KiB\nsecondary_tiers:\n  - {{type: fs, root_dir: {root}}}\n"
    )
    backend = attach(host_pool(), extra_config(kvtier_config_file=str(config_file)))
    try:
        assert [tier.tier_type for tier in backend.kv.manager.tiers] == ["fs"]
        assert backend.kv.config.cpu_bytes_to_use == 64 * 1024
    finally:
        backend.close()


@pytest.mark.parametrize(
    ("extra", "path", "message"),
    [
        (
            extra_config({}, kvtier_lookup_timeout=1),
            "hicache_storage_backend_extra_config.kvtier_lookup_timeout",
            "did you mean 'kvtier_lookup_timeout_s'",
        ),
        (
            extra_config({}, kvtier_cofnig_file="x.yaml"),
            "hicache_storage_backend_extra_config.kvtier_cofnig_file",
            "did you mean 'kvtier_config_file'",
        ),
        (
            extra_config({"secondary_tiers": [{"type": "fs", "root_dri": "/tmp/x"}]}),
            "hicache_storage_backend_extra_config.kvtier.secondary_tiers[0].root_dri",
            "did you mean 'root_dir'",
        ),
        (
            extra_config({"cpu_bytes_to_use": "lots"}),
            "hicache_storage_backend_extra_config.kvtier.cpu_bytes_to_use",
            "write a size such as 8GiB",
        ),
        (
            extra_config({}, kvtier_config_file="kvtier.yaml"),
            "hicache_storage_backend_extra_config",
            "not both",
        ),
        (
            extra_config(None, kvtier_lookup_timeout_s=-1),
            "hicache_storage_backend_extra_config.kvtier_lookup_timeout_s",
            "greater than or equal to 0",
        ),
    ],
)
def test_bad_configuration_fails_at_start_with_its_path(
    extra: dict[str, Any], path: str, message: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        attach(host_pool(), extra)
    text = str(raised.value)
    assert f"{path}:" in text and message in text, text


def test_sglangs_own_keys_pass_and_a_page_size_mismatch_fails(tmp_path: Path) -> None:
    extra = extra_config(fs_config(tmp_path, chunk_tokens=16), prefetch_threshold=256)
    with pytest.raises(ConfigError, match=r"chunk_tokens: 16 differs from SGLang's page size of 4"):
        attach(host_pool(), extra)
    backend = attach(host_pool(), extra_config(fs_config(tmp_path, chunk_tokens=PAGE)))
    backend.close()


@pytest.mark.parametrize("model", ["", "acme/not-on-this-machine"])
def test_a_model_kvtier_cannot_identify_needs_kvtier_model_id(tmp_path: Path, model: str) -> None:
    with pytest.raises(ConfigError, match="kvtier_model_id"):
        attach(host_pool(), extra_config(fs_config(tmp_path)), model=model)
    backend = attach(
        host_pool(), extra_config(fs_config(tmp_path), kvtier_model_id="acme/tiny"), model=model
    )
    try:
        assert backend.kv.layout.model_id == "acme/tiny"
    finally:
        backend.close()


def found_before_and_after_a_change_in_place(
    root: Path, files: Path, seed: int, **config: Any
) -> tuple[int, int]:
    """Pages stored, then found by the same deployment, then by one whose
    ``files/model.safetensors`` changed in place (size and time kept)."""
    keys = page_hashes(TOKENS)
    pool = host_pool()
    fill(pool, seed=seed)
    backend = attach(pool, extra_config(fs_config(root)), **config)
    try:
        assert all(backend.batch_set_v1(keys, indices(0, len(keys))))
    finally:
        backend.close()
    found = []
    for change in (False, True):
        if change:
            weights = files / "model.safetensors"
            stat = weights.stat()
            write_weights(files, bytes(range(64)))  # k/v projections scaled, say
            os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        again = attach(host_pool(), extra_config(fs_config(root)), **config)
        try:
            found.append(again.batch_exists(keys))
        finally:
            again.close()
    return found[0], found[1]


def test_weights_changed_in_place_share_nothing(tmp_path: Path) -> None:
    """New weights at the same path (size and time kept) never read the old pages."""
    model = Path(tmp_path / "model")
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    write_weights(model, bytes(64))
    found = found_before_and_after_a_change_in_place(tmp_path / "kv", model, 8, model=str(model))
    assert found == (len(TOKENS) // PAGE, 0)


def test_a_lora_adapter_retrained_under_its_launch_name_shares_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang names an adapter of --lora-paths by its name and path: servers
    launched with other files there must not share pages."""
    from kvtier.integrations.sglang import engine_config

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    write_weights(adapter, bytes(64))
    monkeypatch.setattr(engine_config, "launch_lora_paths", lambda _args: [f"tuned={adapter}"])
    found = found_before_and_after_a_change_in_place(tmp_path / "kv", adapter, 9)
    assert found == (len(TOKENS) // PAGE, 0)


def test_launch_arguments_that_change_the_kv_share_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On-the-fly quantisation or a config override given at launch changes
    the KV the same files compute: such servers never read each other's pages."""
    from types import SimpleNamespace

    from kvtier.integrations.sglang import engine_config

    scales = tmp_path / "kv_scales.json"
    scales.write_text('{"k": 1.0}')
    base: dict[str, Any] = {name: None for name in engine_config.KV_SERVER_ARGS} | {"dtype": "auto"}
    launches = {
        "plain": base,
        "fp8 weights": base | {"quantization": "fp8"},
        "rope override": base | {"json_model_override_args": '{"rope_theta": 1000.0}'},
        "kv scales": base | {"quantization_param_path": str(scales)},
        "context length": base | {"context_length": 2048},
        "embedding model": base | {"is_embedding": True},
        "remote code": base | {"trust_remote_code": True},
        "modelopt fp8": base | {"modelopt_quant": "fp8"},
        "modelopt checkpoint": base | {"modelopt_checkpoint_restore_path": str(scales)},
        "loader config": base | {"model_loader_extra_config": '{"enable_multithread": 1}'},
        "random weights": base | {"load_format": "dummy"},
        "random weights again": base | {"load_format": "dummy"},
    }

    def launched(launch: dict[str, Any]) -> None:
        monkeypatch.setattr(engine_config, "launch_server_args", lambda: SimpleNamespace(**launch))

    root, keys = tmp_path / "kv", page_hashes(TOKENS)
    pool = host_pool()
    fill(pool, seed=10)
    for name, launch in launches.items():
        launched(launch)
        backend = attach(pool, extra_config(fs_config(root)))
        try:
            assert backend.batch_exists(keys) == 0, name  # nothing another launch stored
            assert all(backend.batch_set_v1(keys, indices(0, len(keys))))
        finally:
            backend.close()
    # The same launch again finds its pages; the scales file by its content.
    scales.write_text('{"k": 2.0}')
    for launch, found in ((launches["rope override"], len(keys)), (launches["kv scales"], 0)):
        launched(launch)
        again = attach(host_pool(), extra_config(fs_config(root)))
        try:
            assert again.batch_exists(keys) == found
        finally:
            again.close()


def test_the_launch_revision_and_download_dir_pick_the_snapshot_identified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--revision v2 --download-dir D``: the weights are v2's snapshot in D,
    not whatever ``main`` points at. A branch moves, so its name alone does
    not identify the weights."""
    from types import SimpleNamespace

    from kvtier.integrations.sglang import engine_config
    from kvtier.testing.hub import hub_snapshot

    cache = tmp_path / "hub"
    for commit, values in (("a" * 40, bytes(64)), ("b" * 40, bytes(range(64)))):
        files = tmp_path / commit[0]
        files.mkdir()
        (files / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
        write_weights(files, values)
        hub_snapshot(cache, "org/tiny", files, commit)  # main: the last one, b
    branch = cache / "models--org--tiny" / "refs" / "v2"
    launch: dict[str, Any] = {name: None for name in engine_config.KV_SERVER_ARGS}
    launch |= {"revision": "v2", "download_dir": str(cache)}
    monkeypatch.setattr(engine_config, "launch_server_args", lambda: SimpleNamespace(**launch))
    storage = SimpleNamespace(model_name="org/tiny")
    facts = []
    for commit in ("a" * 40, "b" * 40):
        branch.write_text(commit)
        facts.append(engine_config.model_facts(storage, SimpleNamespace(), None))
    weights = [dict(fact.extra)["weights"] for fact in facts]
    assert weights[0] != weights[1]
    main = {name: None for name in engine_config.KV_SERVER_ARGS} | {"download_dir": str(cache)}
    monkeypatch.setattr(engine_config, "launch_server_args", lambda: SimpleNamespace(**main))
    on_main = engine_config.model_facts(storage, SimpleNamespace(), None)
    assert dict(on_main.extra)["weights"] == weights[1]


@pytest.mark.parametrize("load_format", ["remote_instance", "remote", "ipc_cache", "private"])
def test_weights_loaded_from_elsewhere_than_files_need_kvtier_model_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, load_format: str
) -> None:
    """Weights sent by another instance or a private loader are not the files
    at the model path (another instance may have updated its own)."""
    from types import SimpleNamespace

    from kvtier.integrations.sglang import engine_config

    launch = {name: None for name in engine_config.KV_SERVER_ARGS} | {"load_format": load_format}
    monkeypatch.setattr(engine_config, "launch_server_args", lambda: SimpleNamespace(**launch))
    storage = SimpleNamespace(model_name=model_dir())
    with pytest.raises(ConfigError, match=f"kvtier_model_id.*--load-format {load_format}"):
        engine_config.model_facts(storage, SimpleNamespace(), None)
    declared = engine_config.model_facts(storage, SimpleNamespace(), "acme/tiny@1")
    assert dict(declared.extra)["weights"] == "declared:acme/tiny@1"


def test_launch_adapters_are_read_in_every_form_sglang_takes_and_must_be_identifiable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from types import SimpleNamespace

    from kvtier.integrations.sglang import engine_config

    assert engine_config.launch_server_args() is None  # no server published its arguments here
    assert engine_config.launch_lora_paths(None) is None
    assert (
        engine_config.launch_lora_paths(SimpleNamespace(enable_lora=False, lora_paths=["a"]))
        is None
    )
    forms = [
        "a=/x/a",
        "/x/b",
        {"lora_name": "c", "lora_path": "/x/c"},
        SimpleNamespace(lora_name="d", lora_path="/x/d"),
    ]
    assert engine_config.preloaded_adapters(forms) == [
        ("a", "/x/a"),
        ("/x/b", "/x/b"),
        ("c", "/x/c"),
        ("d", "/x/d"),
    ]
    assert engine_config.preloaded_adapters({"e": "/x/e"}) == [("e", "/x/e")]
    assert engine_config.adapter_facts(None) == engine_config.adapter_facts([]) == ()
    # Two adapters whose files trade places are another launch, not the same one.
    first, second = tmp_path / "p1", tmp_path / "p2"
    for directory, values in ((first, bytes(64)), (second, bytes(range(64)))):
        directory.mkdir()
        write_weights(directory, values)
    launch = [f"x={first}", f"y={second}"]
    before = engine_config.adapter_facts(launch)
    swapped = tmp_path / "swap"
    (first / "model.safetensors").rename(swapped)
    (second / "model.safetensors").rename(first / "model.safetensors")
    swapped.rename(second / "model.safetensors")
    assert engine_config.adapter_facts(launch) != before
    monkeypatch.setattr(
        engine_config, "launch_lora_paths", lambda _args: ["remote=org/not-downloaded"]
    )
    with pytest.raises(ConfigError, match="'remote'"):
        attach(host_pool(), extra_config(fs_config(tmp_path / "kv")))


def test_a_page_of_the_wrong_size_is_refused_and_nothing_is_stored(tmp_path: Path) -> None:
    pool = host_pool()
    keys = page_hashes(TOKENS[: 2 * PAGE])
    backend = attach(pool, extra_config(fs_config(tmp_path)))
    try:
        good = pool.get_data_page(0).clone()
        with pytest.raises(ValueError, match=r"values\[1\]: a 8-byte tensor"):
            backend.batch_set(keys, [good, torch.zeros(4, dtype=torch.bfloat16)])
        assert backend.batch_exists(keys) == 0
        assert backend.batch_set_v1(keys, indices(0, 1)) == [False, False]
        assert backend.batch_exists(keys) == 0
    finally:
        backend.close()


def test_mla_pages_round_trip_and_are_shared_by_tp_ranks(tmp_path: Path) -> None:
    """An MLA page is the same on every TP rank, so rank 1 finds rank 0's pages."""
    root = tmp_path / "kv"
    pool = mla_host_pool()
    fill(pool, seed=7)
    keys = page_hashes(TOKENS)
    written = [page_digest(pool, page * PAGE) for page in range(len(keys))]
    backend = attach(pool, extra_config(fs_config(root)), mla=True, tp_rank=0, tp_size=2)
    try:
        assert backend.kv.layout.slot_bytes == pool.get_dummy_flat_data_page().numel() * 2
        assert all(backend.batch_set_v1(keys, indices(0, len(keys))))
    finally:
        backend.close()
    other_rank = mla_host_pool()
    backend = attach(other_rank, extra_config(fs_config(root)), mla=True, tp_rank=1, tp_size=2)
    try:
        assert backend.batch_get_v1(keys, indices(0, len(keys))) == [True] * len(keys)
        assert [page_digest(other_rank, page * PAGE) for page in range(len(keys))] == written
    finally:
        backend.close()
    # An MHA deployment of the same model name reads none of them.
    mha = attach(host_pool(), extra_config(fs_config(root)))
    try:
        assert mha.batch_exists(keys) == 0
    finally:
        mha.close()


def test_prefetch_and_backup_threads_at_once_read_only_whole_written_pages(
    tmp_path: Path,
) -> None:
    """SGLang calls a backend from its backup and prefetch threads together:
    whatever the interleaving, a page read back is the page written."""
    pool = host_pool()
    fill(pool, seed=8)
    tokens = list(range(5000, 5000 + 12 * PAGE))
    keys = page_hashes(tokens)
    written = [page_digest(pool, page * PAGE) for page in range(len(keys))]
    backend = attach(pool, extra_config(fs_config(tmp_path, cpu_bytes_to_use="6KiB")))
    errors: list[BaseException] = []
    reads: list[int] = []

    def backup() -> None:
        try:
            for page, key in enumerate(keys):
                assert backend.batch_set_v1([key], indices(page, 1)) == [True]
        except BaseException as exc:
            errors.append(exc)

    def prefetch() -> None:
        try:
            for _ in range(30):
                found = backend.batch_exists(keys)
                # Into pages 20 on: pages 0 to 11 are the backup's source.
                loaded = backend.batch_get_v1(keys[:found], indices(20, found))
                got = sum(loaded)
                for page in range(got):
                    assert page_digest(pool, (20 + page) * PAGE) == written[page]
                reads.append(got)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=backup), threading.Thread(target=prefetch)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        assert len(reads) == 30
        assert backend.batch_get_v1(keys, indices(20, len(keys))) == [True] * len(keys)
        assert [page_digest(pool, (20 + page) * PAGE) for page in range(len(keys))] == written
    finally:
        backend.close()
