"""The model identity every engine integration mixes into its namespace."""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.identity import (
    AdapterIdentities,
    ModelIdentity,
    WeightsIdentity,
    config_digest,
    hub_revision,
    identify_weights,
    locate_model,
    weights_identity,
)
from kvtier.identity import weights as weights_module
from kvtier.testing.hub import hub_snapshot

# Tensors of a small "checkpoint": big enough that the file is sampled, not
# read whole, and that every tensor has bytes outside its sampled windows.
TENSORS = {
    "model.layers.0.self_attn.k_proj.weight": (64, 64),
    "model.layers.0.self_attn.v_proj.weight": (64, 64),
    "model.layers.0.mlp.up_proj.weight": (1024, 256),
    "model.norm.weight": (64,),
}


def write_safetensors(path: Path, seed: int = 0, scale: dict[str, float] | None = None) -> None:
    rng = np.random.default_rng(seed)
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, shape in TENSORS.items():
        data = rng.standard_normal(shape).astype(np.float32) * (scale or {}).get(name, 1.0)
        raw = data.tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def tensor_span(path: Path, name: str) -> tuple[int, int]:
    """Absolute (begin, end) of a tensor's data in a safetensors file."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8 : 8 + size])[name]["data_offsets"]
    return 8 + size + begin, 8 + size + end


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "rope_theta": 1e4}))
    write_safetensors(model / "model.safetensors")
    (model / "extra.bin").write_bytes(np.random.default_rng(1).bytes(300_000))
    sampled = weights_module.FILE_WINDOWS * weights_module.FILE_WINDOW_BYTES
    assert (model / "model.safetensors").stat().st_size > 2 * sampled
    return model


def edit_keeping_time(path: Path, offset: int, data: bytes) -> None:
    """Overwrite bytes in place and put the modification time back."""
    stat = path.stat()
    with open(path, "r+b") as out:
        out.seek(offset)
        out.write(data)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def flip(path: Path, offset: int) -> None:
    byte = path.read_bytes()[offset]
    edit_keeping_time(path, offset, bytes([byte ^ 0xFF]))


def unsampled_offset(path: Path, tensor: str) -> int:
    """A byte of ``tensor`` outside every window the sampled identity reads."""
    size = path.stat().st_size
    file_window = weights_module.FILE_WINDOW_BYTES
    step = (size - file_window) // (weights_module.FILE_WINDOWS - 1)
    file_windows = [(k * step, file_window) for k in range(weights_module.FILE_WINDOWS)]
    begin, end = tensor_span(path, tensor)
    window = weights_module.TENSOR_WINDOW_BYTES
    middle = begin + (end - begin - window) // 2
    tensor_windows = [(begin, window), (middle, window), (end - window, window)]
    for offset in range(begin, end, 4096):
        if not any(start <= offset < start + n for start, n in file_windows + tensor_windows):
            return offset
    raise AssertionError("no unsampled byte in the test tensor")


def digest(path: Path, full_read: bool = False) -> str:
    return weights_identity(path, full_read=full_read).digest


# Weights ---------------------------------------------------------------------


def test_identity_is_deterministic_and_counts_what_it_read(model_dir: Path) -> None:
    first = weights_identity(model_dir)
    assert weights_identity(model_dir) == first
    assert first.files == 3 and first.revision is None and not first.full_read
    assert first.total_bytes == sum(f.stat().st_size for f in model_dir.iterdir())
    assert 0 < first.bytes_read < first.total_bytes  # sampled, not read whole
    assert first.token == f"files-sampled:{first.digest}"
    full = weights_identity(model_dir, full_read=True)
    assert full.bytes_read == full.total_bytes
    assert full.digest != first.digest


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_a_byte_changed_in_a_sampled_window_of_a_tensor_changes_it(
    model_dir: Path, where: str
) -> None:
    weights = model_dir / "model.safetensors"
    before = digest(model_dir)
    begin, end = tensor_span(weights, "model.layers.0.mlp.up_proj.weight")
    offset = {"start": begin, "middle": (begin + end) // 2, "end": end - 1}[where]
    flip(weights, offset)
    assert digest(model_dir) != before


def test_scaled_weights_with_the_same_size_and_time_change_it(model_dir: Path) -> None:
    """The outside run's swap: k_proj and v_proj scaled in place."""
    weights = model_dir / "model.safetensors"
    before = digest(model_dir)
    stat = weights.stat()
    write_safetensors(
        weights, scale={"model.layers.0.self_attn.k_proj.weight": 1.5,
                        "model.layers.0.self_attn.v_proj.weight": 1.5},
    )  # fmt: skip
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights.stat().st_size == stat.st_size
    assert digest(model_dir) != before


def test_a_byte_outside_every_window_is_seen_only_by_its_time_or_a_full_read(
    model_dir: Path,
) -> None:
    """The documented limit: a same-size change that keeps the time and misses
    every sampled window goes unnoticed, unless the files are read whole."""
    weights = model_dir / "model.safetensors"
    sampled, full = digest(model_dir), digest(model_dir, full_read=True)
    offset = unsampled_offset(weights, "model.layers.0.mlp.up_proj.weight")
    flip(weights, offset)
    assert digest(model_dir) == sampled
    assert digest(model_dir, full_read=True) != full
    os.utime(weights)  # any write that updates the time is seen
    assert digest(model_dir) != sampled


def test_size_time_and_header_changes_change_it(model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    before = digest(model_dir)

    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert digest(model_dir) != before
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert digest(model_dir) == before

    raw = weights.read_bytes()
    header_at = raw.index(b'"F32"')  # the first tensor's dtype, same length
    edit_keeping_time(weights, header_at, b'"I32"')
    assert digest(model_dir) != before
    edit_keeping_time(weights, header_at, b'"F32"')
    assert digest(model_dir) == before

    with open(weights, "ab") as out:
        out.write(b"\0")
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert digest(model_dir) != before


def test_other_files_are_sampled_and_small_files_read_whole(model_dir: Path) -> None:
    before = digest(model_dir)
    flip(model_dir / "extra.bin", 0)  # inside the first file window
    changed_bin = digest(model_dir)
    assert changed_bin != before
    config = model_dir / "config.json"
    text = config.read_text()
    edit_keeping_time(config, text.index("1e4") if "1e4" in text else text.index("10000"), b"2")
    assert digest(model_dir) != changed_bin
    (model_dir / "tokenizer.json").write_text("{}")  # a new file counts too
    assert weights_identity(model_dir).files == 4


def test_hidden_files_do_not_count(model_dir: Path) -> None:
    before = digest(model_dir)
    (model_dir / ".cache" / "huggingface").mkdir(parents=True)
    (model_dir / ".cache" / "huggingface" / "download.lock").write_text("x")
    (model_dir / ".gitattributes").write_text("*.safetensors filter=lfs")
    assert digest(model_dir) == before


def test_a_copy_elsewhere_is_the_same_model_if_it_keeps_contents_and_times(
    model_dir: Path, tmp_path: Path
) -> None:
    """The path is not part of the identity; the times are, unless read whole."""
    kept = shutil.copytree(model_dir, tmp_path / "elsewhere" / "renamed")  # copy2 keeps times
    assert digest(kept) == digest(model_dir)
    fresh = shutil.copytree(model_dir, tmp_path / "fresh", copy_function=shutil.copyfile)
    for file in fresh.iterdir():
        os.utime(file, ns=(1, 1))
    assert digest(fresh) != digest(model_dir)
    assert digest(fresh, full_read=True) == digest(model_dir, full_read=True)


def test_a_single_weights_file_is_identified_too(model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    identity = weights_identity(weights)
    assert identity.files == 1 and identity.total_bytes == weights.stat().st_size
    flip(weights, tensor_span(weights, "model.norm.weight")[0])
    assert weights_identity(weights).digest != identity.digest


def test_a_header_that_does_not_parse_still_identifies_the_file(tmp_path: Path) -> None:
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(struct.pack("<Q", 64) + b"{not json" + bytes(200_000))
    before = digest(broken)
    flip(broken, 10)  # inside the header
    assert digest(broken) != before
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 2**62) + bytes(200_000))
    assert weights_identity(huge).files == 1


def test_a_header_with_hostile_offsets_or_nesting_still_identifies_the_file(
    tmp_path: Path,
) -> None:
    before_data = {"t": {"dtype": "F32", "shape": [4], "data_offsets": [-10_000, 16]}}
    for name, header in (
        ("before.safetensors", json.dumps(before_data).encode()),
        ("nested.safetensors", b"[" * 100_000 + b"]" * 100_000),
    ):
        path = tmp_path / name
        path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(200_000))
        before = digest(path)
        flip(path, 8)  # inside the header
        assert digest(path) != before


def test_weights_in_a_linked_directory_count(model_dir: Path, tmp_path: Path) -> None:
    shards = tmp_path / "other-disk"
    shards.mkdir()
    (model_dir / "model.safetensors").rename(shards / "model.safetensors")
    (model_dir / "shards").symlink_to(shards, target_is_directory=True)
    (shards / "cycle").symlink_to(model_dir, target_is_directory=True)  # walked once
    (model_dir / "again").symlink_to(shards, target_is_directory=True)
    identity = weights_identity(model_dir)
    assert identity.files == 3  # config.json, extra.bin, the shard once
    assert weights_identity(model_dir).digest == identity.digest
    weights = shards / "model.safetensors"
    flip(weights, tensor_span(weights, "model.norm.weight")[0])
    assert weights_identity(model_dir).digest != identity.digest


def test_an_unreadable_file_counts_by_size_and_time(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    readable = weights_identity(model_dir)
    denied = model_dir / "extra.bin"
    real_open = open

    def deny(file: object, *args: object, **kwargs: object) -> object:
        # What the OS answers a non-root user for a file of mode 000.
        if Path(str(file)) == denied:
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(weights_module, "open", deny, raising=False)
    identity = weights_identity(model_dir)  # the engine starts: no exception
    assert identity.files == readable.files and identity.total_bytes == readable.total_bytes
    assert identity.digest != readable.digest
    assert weights_identity(model_dir).digest == identity.digest
    stat = denied.stat()
    os.utime(denied, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert weights_identity(model_dir).digest != identity.digest


def test_missing_or_empty_paths_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"absent does not exist"):
        weights_identity(tmp_path / "absent")
    (tmp_path / "empty" / ".hidden").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"empty holds no file"):
        weights_identity(tmp_path / "empty")


# Hugging Face cache ------------------------------------------------------------

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, model_dir: Path, commit: str = COMMIT) -> Path:
    return hub_snapshot(root, "org/tiny", model_dir, commit)


def test_a_hub_snapshot_is_identified_by_revision_and_content_not_by_times(
    model_dir: Path, tmp_path: Path
) -> None:
    one = hub_cache(tmp_path / "machine-a", model_dir)
    two = hub_cache(tmp_path / "machine-b", model_dir)
    for blob in (one.parents[1] / "blobs").iterdir():
        os.utime(blob, ns=(5, 5))  # downloaded at another time
    first = weights_identity(one)
    assert first.revision == COMMIT and hub_revision(one / "config.json") == COMMIT
    assert weights_identity(two).digest == first.digest
    other = hub_cache(tmp_path / "machine-c", model_dir, commit="f" * 40)
    assert weights_identity(other).digest != first.digest
    # A blob changed in place (which the hub cache never does) is still
    # sampled like any file.
    flip(one / "model.safetensors", tensor_span(one / "model.safetensors", "model.norm.weight")[0])
    assert weights_identity(one).digest != first.digest


def test_locate_model_finds_local_paths_and_cached_snapshots(
    model_dir: Path, tmp_path: Path
) -> None:
    pytest.importorskip("huggingface_hub")
    assert locate_model(str(model_dir)) == model_dir
    cache = tmp_path / "hub"
    snapshot = hub_cache(cache, model_dir)
    found = locate_model("org/tiny", cache_dirs=(tmp_path / "elsewhere", cache))
    assert found is not None and found.resolve() == snapshot.resolve()
    assert locate_model("org/tiny", revision=COMMIT, cache_dirs=(cache,)) == found
    assert locate_model("org/absent", cache_dirs=(cache,)) is None
    assert locate_model("/no/such/model", cache_dirs=(cache,)) is None


def test_identify_weights_locates_identifies_and_logs_the_cost(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("huggingface_hub")
    cache = tmp_path / "hub"
    hub_cache(cache, model_dir)
    with caplog.at_level("INFO", logger="kvtier.identity"):
        found = identify_weights("org/tiny", cache_dirs=(cache,))
    located = locate_model("org/tiny", cache_dirs=(cache,))
    assert located is not None
    assert found is not None and found == weights_identity(located)
    assert found.revision == COMMIT
    assert "weights of org/tiny identified from 3 files" in caplog.text
    assert f"revision {COMMIT}" in caplog.text
    assert identify_weights("org/absent", cache_dirs=(cache,)) is None
    assert identify_weights(str(model_dir)) == weights_identity(model_dir)


# Config ------------------------------------------------------------------------


BASE_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 8192,
    "text_config": {"hidden_size": 64, "_name_or_path": "/a/path"},
    "_name_or_path": "/models/llama",
    "transformers_version": "4.56.0",
}


@pytest.mark.parametrize(
    "change",
    [
        {"rope_theta": 500000.0},
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
        {"max_position_embeddings": 131072},
        {"quantization": "fp8"},
        {"architectures": ["MistralForCausalLM"]},
        {"text_config": {"hidden_size": 128}},
    ],
    ids=lambda change: next(iter(change)),
)
def test_any_config_entry_that_matters_changes_the_digest(change: dict[str, object]) -> None:
    assert config_digest({**BASE_CONFIG, **change}) != config_digest(BASE_CONFIG)


def test_bookkeeping_and_order_do_not_change_the_digest() -> None:
    moved = {
        **dict(reversed(list(BASE_CONFIG.items()))),
        "_name_or_path": "/elsewhere",
        "transformers_version": "5.0.0",
        "text_config": {"_name_or_path": "/b", "hidden_size": 64},
    }
    assert config_digest(moved) == config_digest(BASE_CONFIG)


def test_config_values_of_any_type_digest_stably() -> None:
    import enum
    from dataclasses import dataclass

    class Kind(enum.Enum):
        FP8 = "fp8"

    @dataclass
    class Quant:
        kind: Kind
        groups: frozenset[int]

    config = {"quant": Quant(Kind.FP8, frozenset({3, 1, 2})), "raw": b"\x01", "cls": Quant}
    assert config_digest(config) == config_digest(dict(config))
    other = {**config, "quant": Quant(Kind.FP8, frozenset({1, 2}))}
    assert config_digest(other) != config_digest(config)


def test_model_identity_feeds_a_layout_namespace() -> None:
    from kvtier.testing import small_layout

    identity = ModelIdentity(config="c" * 24, weights="files-sampled:" + "d" * 32)
    assert identity.layout_extra == (("config", "c" * 24), ("weights", "files-sampled:" + "d" * 32))
    base = small_layout()
    from dataclasses import replace

    one = replace(base, extra=identity.layout_extra)
    two = replace(base, extra=ModelIdentity("c" * 24, "declared:other").layout_extra)
    assert one.namespace != two.namespace != base.namespace


# LoRA adapters -----------------------------------------------------------------


def adapter(root: Path, seed: int) -> Path:
    """A LoRA adapter's directory: its config and its weights."""
    root.mkdir(parents=True)
    (root / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    write_safetensors(root / "adapter_model.safetensors", seed=seed)
    return root


def test_adapters_are_told_apart_by_their_files_not_their_name_or_path(tmp_path: Path) -> None:
    first, second = adapter(tmp_path / "a", 1), adapter(tmp_path / "b", 2)
    engine_a, engine_b = AdapterIdentities(), AdapterIdentities()
    # One name, other files (a retrained adapter deployed under its old name).
    token_a = engine_a.token("support", 1, str(first))
    token_b = engine_b.token("support", 1, str(second))
    assert token_a is not None and token_b is not None and token_a != token_b
    # The same files under another name, id or path (a copy keeping times) are one adapter.
    copy = tmp_path / "copy"
    shutil.copytree(first, copy)
    assert engine_b.token("helpdesk", 7, str(copy)) == token_a


def test_an_adapter_is_identified_once_until_the_engine_reloads_it_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier.identity import adapters as adapters_module

    path = adapter(tmp_path / "a", 1)
    calls: list[str] = []
    real = adapters_module.identify_weights

    def counting(name_or_path: str, **kwargs: Any) -> WeightsIdentity | None:
        calls.append(name_or_path)
        return real(name_or_path, **kwargs)

    monkeypatch.setattr(adapters_module, "identify_weights", counting)
    identities = AdapterIdentities()
    before = identities.token("support", 1, str(path))
    assert identities.token("support", 1, str(path)) == before
    assert len(calls) == 1
    # Retrained in place, size and time kept, the engine not told to reload:
    # it runs what it loaded until it drops the adapter from its own cache
    # and reads the files again. Which it runs is unknown: no token.
    weights = path / "adapter_model.safetensors"
    stat = weights.stat()
    write_safetensors(weights, seed=1, scale={"model.norm.weight": 2.0})
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights.stat().st_size == stat.st_size
    assert identities.token("support", 1, str(path)) is None
    assert identities.token("support", 1, str(path)) is None  # until reloaded
    after = identities.token("support", 1, str(path), reload=True)
    assert after is not None and after != before
    assert identities.token("support", 1, str(path)) == after
    assert len(calls) == 2


def replace_weights(path: Path) -> None:
    """Saved as tools save: a new file renamed over the old one."""
    fresh = path / "adapter_model.safetensors.tmp"
    write_safetensors(fresh, seed=5)
    fresh.rename(path / "adapter_model.safetensors")


def add_shard(path: Path) -> None:
    write_safetensors(path / "adapter_model-extra.safetensors", seed=6)


def remove_config(path: Path) -> None:
    (path / "adapter_config.json").unlink()


def touch_times_back(path: Path) -> None:
    """Rewritten with the same bytes and its old times: its content is what
    the engine loaded, but the change time still moves."""
    config = path / "adapter_config.json"
    stat = config.stat()
    config.write_bytes(config.read_bytes())
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.mark.parametrize("change", [replace_weights, add_shard, remove_config, touch_times_back])
def test_an_adapter_whose_files_change_without_a_reload_is_no_longer_offloaded(
    tmp_path: Path, change: Callable[[Path], None], caplog: pytest.LogCaptureFixture
) -> None:
    path = adapter(tmp_path / "a", 1)
    identities = AdapterIdentities()
    before = identities.token("support", 1, str(path))
    assert before is not None and identities.token("support", 1, str(path)) == before
    change(path)
    assert identities.token("support", 1, str(path)) is None
    assert "changed since it was loaded" in caplog.text
    # Another engine loading the files now identifies them as they are (the
    # same bytes and times: the same identity).
    now = AdapterIdentities().token("support", 1, str(path))
    assert now is not None and (now == before) == (change is touch_times_back)


def test_an_adapter_in_the_hub_cache_is_stable_across_requests(
    model_dir: Path, tmp_path: Path
) -> None:
    """A snapshot's files are links to blobs: checked through the links."""
    cache = tmp_path / "hub"
    hub_cache(cache, model_dir)
    identities = AdapterIdentities(cache_dirs=[cache])
    first = identities.token("tiny", 1, "org/tiny")
    assert first is not None
    assert all(identities.token("tiny", 1, "org/tiny") == first for _ in range(3))


def test_an_adapter_that_cannot_be_identified_has_no_token(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    identities = AdapterIdentities(cache_dirs=[tmp_path / "hub"])
    assert identities.token("remote", 1, "org/not-downloaded-adapter") is None
    assert "'remote'" in caplog.text and "not offloaded" in caplog.text
    assert identities.token("nowhere", 2, str(tmp_path / "missing")) is None
    assert identities.token("unnamed", 3, "") is None
    (tmp_path / "empty").mkdir()
    assert identities.token("empty", 4, str(tmp_path / "empty")) is None
