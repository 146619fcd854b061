"""The benchmarks' drivers, run in their quick modes: sane output, not figures.

Nothing here asserts a time or a speed (CI machines are shared and noisy);
only that each driver runs end to end and reports consistent counts.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.needs import need_mooncake, need_redis_server, need_s3_server

ROOT = Path(__file__).resolve().parents[2]


def run_quick(script: str, *args: str) -> Any:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("KVTIER_SEED_VENV", None)
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--json", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def from_benchmarks(module: str) -> Any:
    """A module of ``benchmarks/``, imported as its drivers run: beside its
    siblings, which it imports by name."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(ROOT / "benchmarks"))
        return importlib.import_module(module)


def test_bench_primary_replays_the_same_trace_through_every_system() -> None:
    out = run_quick("bench_primary.py")
    rows = {(row["system"], row["policy"]): row for row in out["results"]}
    policies = {"lru", "arc", "s3fifo", "leaf-lru"}
    assert set(rows) == {("dict-lru", "lru")} | {("kvtier", p) for p in policies}
    assert "seed not measured" in out["note"]
    trace = out["trace"]
    for row in rows.values():
        assert row["seconds"] > 0 and row["ops_per_s"] > 0
        assert 0 < row["hit_chunks"] <= row["lookup_chunks"]
        assert 0 < row["hit_rate"] < 1
        # Every request looks up at least one chunk and at most all of them.
        assert trace["requests"] <= row["lookup_chunks"] <= row["chunk_ops"]
        assert row["vs_dict_lru"] > 0 and row["vs_seed"] is None
        low, high = row["vs_dict_lru_range"]
        assert low <= row["vs_dict_lru"] <= high
    # Every system saw the same trace: the same chunks in all.
    assert len({round(row["hit_chunks"] / row["hit_rate"]) for row in rows.values()}) == 1
    assert rows[("dict-lru", "lru")]["vs_dict_lru"] == pytest.approx(1.0)


def test_bench_primary_times_each_policy_alone_on_the_calls_it_got() -> None:
    out = run_quick("bench_primary.py", "--policy-cost")
    assert set(out["policy_seconds"]) == {"lru", "arc", "s3fifo", "leaf-lru"}
    assert all(seconds > 0 for seconds in out["policy_seconds"].values())


def test_bench_primary_makes_the_same_operations_with_its_steps_in_python() -> None:
    compiled = run_quick("bench_primary.py")
    python = run_quick("bench_primary.py", "--python")
    assert python["note"].startswith("kvtier's steps: python;")
    counts = ("system", "policy", "chunk_ops", "hit_chunks", "lookup_chunks")
    assert [[row[c] for c in counts] for row in python["results"]] == [
        [row[c] for c in counts] for row in compiled["results"]
    ]


def test_bench_primary_refuses_zero_rounds() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_primary.py"), "--rounds", "0"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and "--rounds must be at least 1" in done.stderr


def test_bench_promotion_promotes_every_chunk_of_each_size() -> None:
    out = run_quick("bench_promotion.py")
    rows = out["results"]
    assert [row["chunks"] for row in rows] == [2, 4, 8]
    for row in rows:
        # A full CPU tier: one idle chunk gives way for each promoted one.
        assert row["evictions"] == row["chunks"]
        assert row["lookup_us_per_chunk"] > 0 and row["promotion_us_per_chunk"] > 0
    assert rows[0]["lookup_vs_smallest"] == pytest.approx(1.0)
    assert rows[0]["promotion_vs_smallest"] == pytest.approx(1.0)


def test_bench_cold_verifies_the_prefix_and_breaks_its_time_down(tmp_path: Path) -> None:
    # The checkout's own src as the baseline: the driver runs both alike.
    out = run_quick("bench_cold.py", "--root", str(tmp_path), "--baseline-src", str(ROOT / "src"))
    assert [r["chunk"] for r in out["results"]] == [256 << 10, 2 << 20]
    for result in out["results"]:
        for name in ("kvtier", "baseline"):
            row = result[name]
            assert row["verified_chunks"] == [out["size"] // result["chunk"]]
            assert row["gbps"]["p50"] > 0 and row["store_gbps"]["p50"] > 0
            parts = row["breakdown"]
            assert parts["io_s"] > 0 and parts["jobs"] >= 1 and parts["lookups"] >= 1
            # The parts the caller's thread spends add up to the cold prefix
            # (one run: no medians in between, only the report's rounding).
            caller = parts["lookup_s"] + parts["step_s"] + parts["waits_s"]
            assert caller == pytest.approx(parts["prefix_s"], abs=1e-3)
            # Per run, where the re-index stood at the lookup: a whole index was listed.
            [listed], [ready] = parts["index_listed"], parts["index_ready"]
            assert isinstance(listed, bool) and isinstance(ready, bool) and listed >= ready
            # The client's CPU, the kernel's reads included; no server to count.
            assert set(row["cpu_s"]) == {"client"} and row["cpu_s"]["client"] > 0
        assert result["kvtier"]["vs_baseline"]["p50"] > 0
        # fio is the ceiling where it is installed; otherwise the run says why not.
        assert ("fio" in result) != ("fio" in out["skipped"])
        # The goals judged from the same figures: the disk's ceiling and the
        # spread where fio ran (one run spreads 0 %), no peer (--no-peer).
        goals = {goal["figure"]: goal for goal in result["goals"]}
        if "fio" in result:
            assert set(goals) == {"vs fio", "spread"} and goals["spread"]["met"]
            ratio = result["kvtier"]["vs_fio"]["p50"]
            assert goals["vs fio"]["value"] == ratio
            assert goals["vs fio"]["met"] == (ratio >= 0.9)
        else:
            assert goals == {}
    assert out["skipped"]["lmcache-disk-odirect"] == "--no-peer"


def test_bench_cold_splits_the_cpu_by_thread_without_counting_past_the_total() -> None:
    import threading

    bench = from_benchmarks("bench_cold")

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    for _ in range(20):  # many short rounds: a read order that double counts shows
        before = bench.cpu_seconds()
        worker = threading.Thread(target=spin, args=(0.02,), name="spinner-1")
        worker.start()
        spin(0.01)
        live = threading.Thread(target=spin, args=(0.01,), name="live-1")
        live.start()
        spent = bench.cpu_spent(before)  # while "live" may still run
        live.join()
        worker.join()
        split = spent["thread_cpu"]
        named = sum(seconds for group, seconds in split.items() if group != "other")
        assert named <= spent["client_cpu_s"] + 1e-5  # microseconds: the total's clock
        assert split["other"] >= 0
        assert split["MainThread"] >= 0.009  # the caller's own spin, not rounded away
        assert sum(split.values()) == pytest.approx(max(named, spent["client_cpu_s"]))


def test_bench_cold_judges_each_goal_at_its_bound() -> None:
    goals = from_benchmarks("bench_cold").goals

    def row(gbps_spread: float, **ratios: float) -> dict[str, Any]:
        return {"gbps": {"spread": gbps_spread}} | {k: {"p50": v} for k, v in ratios.items()}

    def verdicts(found: list[dict[str, Any]]) -> dict[str, bool]:
        return {goal["figure"]: goal["met"] for goal in found}

    fs = row(0.15, vs_fio=0.9, **{"vs_lmcache-disk-odirect": 1.2})
    assert verdicts(goals(fs, "fio")) == {
        "vs fio": True,
        "spread": True,
        "vs lmcache-disk-odirect": True,
    }
    fs = row(0.16, vs_fio=0.89, **{"vs_lmcache-disk-odirect": 1.19})
    assert not any(verdicts(goals(fs, "fio")).values())
    # A remote tier: its raw client is the ceiling, and no spread is asked of it.
    assert verdicts(goals(row(0.9, vs_raw=0.9), "raw")) == {"vs raw": True}
    assert verdicts(goals(row(0.0, vs_raw=0.899), "raw")) == {"vs raw": False}


def test_bench_cold_prints_each_goal_with_the_digits_it_was_judged_by(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = from_benchmarks("bench_cold").report
    missed = [
        {"figure": "vs fio", "goal": ">= 0.9x", "value": 0.899, "met": False},
        {"figure": "spread", "goal": "<= 15%", "value": 0.152, "met": False},
    ]
    args = argparse.Namespace(json=False, tier="fs", threads=32, size=1 << 20, runs=5, codecs=None)
    report(args, [{"chunk": 1 << 20, "chunks": 1, "goals": missed}], {})
    lines = capsys.readouterr().out.splitlines()
    # Not 0.90x and 15 %: a figure that missed its goal never reads as one that met it.
    assert "  goal: kvtier vs fio >= 0.9x: 0.899x, NOT met" in lines
    assert "  goal: kvtier spread <= 15%: 15.2%, NOT met" in lines


@pytest.mark.parametrize(
    ("tier", "need"),
    [("redis", need_redis_server), ("obj", need_s3_server), ("mooncake", need_mooncake)],
)
def test_bench_cold_remote_tier_verifies_the_prefix_against_its_raw_client(
    tier: str, need: Any
) -> None:
    need()
    out = run_quick("bench_cold.py", "--tier", tier)
    assert out["tier"] == tier and out["skipped"] == {}
    assert [r["chunk"] for r in out["results"]] == [256 << 10, 2 << 20]
    for result in out["results"]:
        assert set(result) == {"chunk", "chunks", "kvtier", "raw", "goals"}
        row = result["kvtier"]
        [goal] = result["goals"]
        assert (goal["figure"], goal["value"]) == ("vs raw", row["vs_raw"]["p50"])
        assert goal["met"] == (goal["value"] >= 0.9)
        assert row["verified_chunks"] == [out["size"] // result["chunk"]]
        parts = row["breakdown"]
        # A fresh cache knows nothing of a remote store: every chunk is checked, then
        # promoted (from the value its check read and held, for obj).
        assert parts["checked_keys"] == [result["chunks"]]  # per run
        assert parts["io_s"] > 0 and parts["jobs"] >= 1 and parts["lookups"] >= 1
        caller = parts["lookup_s"] + parts["step_s"] + parts["waits_s"]
        assert caller == pytest.approx(parts["prefix_s"], abs=1e-3)
        assert result["raw"]["gbps"]["p50"] > 0 and row["vs_raw"]["p50"] > 0
        for name in ("kvtier", "raw"):  # the server's CPU beside the client's, for both
            cpu = result[name]["cpu_s"]
            assert set(cpu) == {"client", "server"}
            assert cpu["client"] > 0 and cpu["server"] >= 0
            # The client's split by thread adds up to it (one run: no medians between).
            threads = result[name]["thread_cpu_s"]
            assert {"MainThread", "other"} <= set(threads)
            assert sum(threads.values()) == pytest.approx(cpu["client"], abs=1e-3)
        assert f"kvtier-{tier}" in row["thread_cpu_s"]  # the tier's workers, apart


def test_bench_cold_remote_tier_runs_a_baseline_kvtier_alike() -> None:
    need_s3_server()
    # The checkout's own src as the baseline: both run in child processes alike.
    out = run_quick("bench_cold.py", "--tier", "obj", "--baseline-src", str(ROOT / "src"))
    for result in out["results"]:
        assert set(result) == {"chunk", "chunks", "kvtier", "raw", "baseline", "goals"}
        for name in ("kvtier", "baseline"):
            row = result[name]
            assert row["verified_chunks"] == [out["size"] // result["chunk"]]
            assert row["store_gbps"]["p50"] > 0 and row["vs_raw"]["p50"] > 0
            assert row["breakdown"]["checked_keys"] == [result["chunks"]]
            assert set(row["cpu_s"]) == {"client", "server"}  # counted in the children too
        assert result["kvtier"]["vs_baseline"]["p50"] > 0


def test_bench_obj_client_times_both_clients_at_each_size() -> None:
    need_s3_server()
    out = run_quick("bench_obj_client.py")
    assert set(out) == {str(256 << 10), str(2 << 20)}
    for figures in out.values():
        for client in ("tier", "boto3"):
            assert 0 < figures[client]["least_ms"] <= figures[client]["median_ms"]
        ratio = figures["tier_over_boto3"]
        assert 0 < ratio["least"] <= ratio["median"]


@pytest.mark.parametrize("tier", ["fs", "redis"])
def test_bench_cold_loads_the_prefix_through_each_codec_beside_none(
    tier: str, tmp_path: Path
) -> None:
    if tier == "redis":
        need_redis_server()
    where = ["--root", str(tmp_path)] if tier == "fs" else ["--tier", tier]
    out = run_quick("bench_cold.py", *where, "--chunk", "256KiB", "--codec", "lossless,int8")
    assert out["codecs"] == ["none", "lossless", "int8"]
    [result] = out["results"]
    systems = {"none": "kvtier", "lossless": "kvtier:lossless", "int8": "kvtier:int8"}
    for codec, name in systems.items():
        row = result[name]
        # The driver compared every loaded byte with what the tier serves: the
        # stored bytes (none, lossless) or the codec's own round trip (int8).
        assert row["verified_chunks"] == [result["chunks"]], codec
        figures = row["codec"]
        assert figures["load_s"]["p50"] > 0 and row["gbps"]["p50"] > 0
        if codec == "none":
            assert figures["time_vs_none"]["p50"] == pytest.approx(1.0)
            assert figures["stored_ratio"] == 1.0 and figures["decode_share"] == 0.0
            assert figures["pays_below_gbps"] == 0.0
        else:
            # KV-like bf16 values: both codecs store fewer bytes, and decoding costs time.
            assert figures["stored_ratio"] > 1.2, codec
            assert 0 < figures["decode_share"] < 1, codec
            assert row["breakdown"]["decode_s"] > 0, codec
            pays = figures["pays_below_gbps"]
            assert pays is None or pays > 0, codec


# The peers' drivers run in the peers' own environments (scripts/peer-envs.sh);
# where one is missing its systems skip, saying so. CI builds them all and sets
# KVTIER_REQUIRE_PEER_ENVS, which turns such a skip into a failure.
PEER_SYSTEMS = (
    "lmcache-disk",
    "lmcache-disk-odirect",
    "lmcache-redis",
    "aibrix-shfs",
    "aibrix-rocksdb",
    "sglang-file",
)


@pytest.fixture(scope="module")
def bench_peers_quick(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("bench-peers")
    return run_quick("bench_peers.py", "--root", str(root))


def check_every_chunk_verified(out: Any, system: str) -> None:
    for chunk, rows in out["sizes"].items():
        row = rows[system]
        count = out["volume"] // int(chunk)
        assert row["verified_chunks"] == [count] * out["rounds"]
        assert row["store_median"] > 0 and row["load_median"] > 0
        if system != row.get("kvtier_vs", {}).get("baseline", system):
            assert row["kvtier_vs"]["store"] > 0 and row["kvtier_vs"]["load"] > 0


def test_bench_peers_kvtier_and_the_raw_floors_verify_every_chunk(bench_peers_quick: Any) -> None:
    out = bench_peers_quick
    assert set(out["sizes"]) == {str(2 << 20), str(256 << 10)}
    for system in ("raw-odirect", "kvtier-fs", "raw-redis", "kvtier-redis"):
        check_every_chunk_verified(out, system)
    for rows in out["sizes"].values():
        assert rows["raw-odirect"]["kvtier_vs"]["baseline"] == "kvtier-fs"
        assert rows["raw-redis"]["kvtier_vs"]["baseline"] == "kvtier-redis"
        # The files were evicted from the page cache before every load.
        assert rows["kvtier-fs"]["cold"] in ("drop_caches", "fadvise")


@pytest.mark.parametrize("system", PEER_SYSTEMS)
def test_bench_peers_driver_verifies_every_chunk(bench_peers_quick: Any, system: str) -> None:
    out = bench_peers_quick
    reason = out["skipped"].get(system)
    if reason is not None:
        assert "scripts/peer-envs.sh" in reason
        if os.environ.get("KVTIER_REQUIRE_PEER_ENVS"):
            pytest.fail(f"{system}: {reason}")
        pytest.skip(f"{system}: {reason}")
    check_every_chunk_verified(out, system)
    baseline = "kvtier-redis" if system.endswith("redis") else "kvtier-fs"
    for rows in out["sizes"].values():
        assert rows[system]["kvtier_vs"]["baseline"] == baseline


def test_bench_peers_skips_a_missing_environment_with_its_reason(tmp_path: Path) -> None:
    out = run_quick(
        "bench_peers.py",
        "--root",
        str(tmp_path / "root"),
        "--peer-envs",
        str(tmp_path / "no-envs"),
        "--systems",
        "kvtier-fs,aibrix-shfs",
        "--chunk",
        "256KiB",
    )
    assert set(out["sizes"][str(256 << 10)]) == {"kvtier-fs"}
    reason = out["skipped"]["aibrix-shfs"]
    assert str(tmp_path / "no-envs" / ".venv-aibrix") in reason and "peer-envs.sh" in reason


def test_bench_peers_check_refuses_a_wrong_or_missing_chunk() -> None:
    common = from_benchmarks("peers.common")
    check_chunks = common.check_chunks
    chunk_payloads = common.chunk_payloads
    chunks = chunk_payloads(7, 3, 4096)
    # The same seed gives the same bytes; another seed others.
    assert chunks == chunk_payloads(7, 3, 4096) and chunks != chunk_payloads(8, 3, 4096)
    assert check_chunks("peer", chunks, [bytearray(c) for c in chunks]) == 3
    flipped = bytearray(chunks[1])
    flipped[4095] ^= 1
    with pytest.raises(RuntimeError, match="peer: 1 of 3 chunks loaded wrong or missing"):
        check_chunks("peer", chunks, [chunks[0], flipped, chunks[2]])
    with pytest.raises(RuntimeError, match="first: chunk 2"):
        check_chunks("peer", chunks, [chunks[0], chunks[1], None])


def test_bench_fleet_asks_only_holders_and_counts_its_writes() -> None:
    need_redis_server()
    out = run_quick("bench_fleet.py")
    nodes, stored = out["nodes"], out["chunks_stored"]
    assert out["entries"] == stored  # one entry per chunk held, each by one node
    # ZADD, ZREMRANGEBYSCORE and PEXPIRE per stored chunk; no removals here.
    assert out["index_entry_writes_per_chunk"] == 3
    assert 0 < out["publish_round_trips_per_chunk"] <= 1
    assert out["store_to_visible_ms"]["samples"] == stored // out["prompt_chunks"]
    with_index, without = out["lookups_with_index"], out["lookups_without_index"]
    for row in (with_index, without):
        assert row["tokens_found"] == row["tokens_asked"] > 0
    assert with_index["peer_queries_per_batch"] <= 2
    assert without["peer_queries_per_batch"] == nodes
    routing = out["routing"]
    assert routing["answers_naming_the_holder_first"] == routing["calls"]
    assert out["redis_key_bytes_per_entry"] > 0


def test_bench_index_memory_publishes_every_holder_of_every_key() -> None:
    need_redis_server()
    out = run_quick("bench_index_memory.py")
    rows = {row["holders"]: row for row in out["rows"]}
    assert sorted(rows) == [1, 2, 4, 8]
    for holders, row in rows.items():
        assert row["chunk_keys"] == out["chunks"]
        assert row["entries"] == holders * out["chunks"]
    assert 0 < rows[1]["bytes_per_key"] < rows[8]["bytes_per_key"]


def test_bench_request_path_finds_the_same_hits_through_kvtier_and_the_minimal_cache() -> None:
    out = run_quick("bench_request_path.py")
    rows = {row["system"]: row for row in out["results"]}
    assert set(rows) == {"minimal", "kvtier", "kvtier-keyed"}
    # The driver refuses to report systems that found different hits; some were found.
    assert 0 < out["hit_chunks"] < out["chunks"]
    for row in rows.values():
        assert row["requests_per_s"] > 0 and row["vs_minimal"] > 0
        low, high = row["vs_minimal_range"]
        assert low <= row["vs_minimal"] <= high
    assert rows["minimal"]["vs_minimal"] == pytest.approx(1.0)


def test_bench_codecs_reports_every_codec_and_tier_on_demo_kv() -> None:
    out = run_quick("bench_codecs.py", "--server", "obj")
    rows = {row["codec"]: row for row in out["codecs"]}
    assert {"lossless", "fp8", "int8", "int4"} <= set(rows)
    assert rows["lossless"]["exact"] and not rows["int4"]["exact"]
    assert rows["int4"]["ratio"] > rows["fp8"]["ratio"] > 1
    for row in out["codecs"]:
        assert row["encode_gbps"] > 0 and row["decode_gbps"] > 0
    tiers = {(row["tier"], row["codec"]): row for row in out["tiers"]}
    codecs = ("none", "lossless", "fp8", "int8", "int4")
    kinds = ("memory", "memory-bounded", "fs", "obj")
    assert {(tier, codec) for tier in kinds for codec in codecs} == set(tiers)
    assert all(row["store_gbps"] > 0 and row["load_gbps"] > 0 for row in out["tiers"])
    for tier in ("fs", "obj"):  # varying sizes stored smaller than the raw chunks
        lossless, raw = tiers[(tier, "lossless")], tiers[(tier, "none")]
        assert lossless["stored_bytes_per_chunk"] < raw["stored_bytes_per_chunk"]
        assert raw["load_vs_none"] == 1
        assert lossless["load_vs_none"] == pytest.approx(
            lossless["load_gbps"] / raw["load_gbps"], abs=1e-3
        )


def test_bench_codec_quality_trains_once_and_rates_every_codec_against_exact(
    tmp_path: Path,
) -> None:
    first = run_quick("bench_codec_quality.py", "--cache-dir", str(tmp_path))
    rows = {row["codec"]: row for row in first["results"]}
    assert {"none", "lossless", "fp8", "int8", "int4"} <= set(rows)
    for exact in ("none", "lossless"):  # the same KV: the same outputs
        assert rows[exact]["kl_nats"] == 0 and rows[exact]["greedy_agreement"] == 1
        assert rows[exact]["perplexity"] == rows["none"]["perplexity"]
        assert rows[exact]["byte_exact"]
    assert not rows["int4"]["byte_exact"] and rows["int4"]["ratio"] > rows["int8"]["ratio"] > 1
    assert all(row["kl_nats"] >= 0 for row in rows.values())
    assert len(list(tmp_path.glob("model-*.pt"))) == 1
    again = run_quick("bench_codec_quality.py", "--cache-dir", str(tmp_path))
    assert again["model"] == first["model"]  # the cached model, not a second training


def test_bench_vllm_work_directory_is_removed_after_a_run_kept_after_a_failure(
    capsys: pytest.CaptureFixture[str],
) -> None:
    work_directory = from_benchmarks("bench_vllm").work_directory
    with work_directory("kvtier-test-work-") as work:
        (work / "model").mkdir()
    assert not work.exists()
    with pytest.raises(RuntimeError), work_directory("kvtier-test-work-") as kept:
        (kept / "engine.log").write_text("what the engine said")
        raise RuntimeError("an engine failed")
    try:
        assert (kept / "engine.log").read_text() == "what the engine said"
        assert str(kept) in capsys.readouterr().err
    finally:
        shutil.rmtree(kept)


def test_bench_look_spacing_times_capped_and_uncapped_pairs_on_one_prefix() -> None:
    need_redis_server()
    out = run_quick("bench_look_spacing.py", "--tier", "redis")
    assert out["tier"] == "redis" and out["pairs"] == 2
    assert set(out["seconds_p50"]) == {"capped", "uncapped"}
    assert all(seconds > 0 for seconds in out["seconds_p50"].values())
    ratio = out["uncapped_over_capped"]
    assert 0 < ratio["min"] <= ratio["p50"] <= ratio["max"]


def test_bench_look_cost_reports_every_figure_for_kvtier_and_its_baseline() -> None:
    need_redis_server()
    out = run_quick("bench_look_cost.py", "--baseline-src", str(ROOT / "src"))
    assert (out["keys"], out["pairs"]) == (64, 1)
    figures = {"look_us", "lookup_memory_us", "lookup_redis_us", "prefix_s"}
    for name in ("kvtier", "baseline"):
        assert set(out["p50"][name]) == figures
        assert all(value > 0 for value in out["p50"][name].values())
    ratios = out["baseline_over_kvtier"]
    assert set(ratios) == figures and all(len(r) == 1 and r[0] > 0 for r in ratios.values())


def test_bench_busy_copies_reports_every_figure_for_kvtier_and_its_baseline() -> None:
    out = run_quick("bench_busy_copies.py", "--baseline-src", str(ROOT / "src"))
    assert (out["size"], out["pairs"]) == (8 << 20, 1)
    moves = {f"{move}_{when}" for move in ("store", "load", "fs") for when in ("alone", "busy")}
    figures = {f"{move}_s" for move in moves} | {"raw_alone_s", "raw_busy_s"}
    for name in ("kvtier", "baseline"):
        assert set(out["p50"][name]) == figures
        assert all(seconds > 0 for seconds in out["p50"][name].values())
        assert set(out["over_raw"][name]) == moves
    ratios = out["baseline_over_kvtier"]
    assert set(ratios) == {f"{move}_s" for move in moves}
    assert all(len(r) == 1 and r[0] > 0 for r in ratios.values())


def test_bench_map_ahead_reports_the_mapping_and_the_stalls_beside_their_floor() -> None:
    out = run_quick("bench_map_ahead.py", "--baseline-src", str(ROOT / "src"))
    assert (out["size"], out["busy"], out["named"], out["pairs"]) == (64 << 20, 0, False, 1)
    for figures in out["medians"].values():
        assert figures["map_s"] > 0
        for suffix in ("", "_alone"):
            assert 0 < figures[f"p50_ms{suffix}"] <= figures[f"p99_ms{suffix}"]
            assert figures[f"p99_ms{suffix}"] <= figures[f"max_ms{suffix}"]
            assert figures[f"stalled_s{suffix}"] >= 0
    assert set(out["medians"]) == {"kvtier", "baseline"}
    ratios = out["baseline_over_kvtier"]
    assert set(ratios) == {"map_s", "p50_ms", "max_ms"}
    assert all(len(r) == 1 and r[0] > 0 for r in ratios.values())
