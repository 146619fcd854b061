"""``kvtier simulate --replicas``: routing across replicas, blind and by kvtier's scores."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvtier.cli import cli
from kvtier.policies.lru import LRUCachePolicy
from kvtier.sim.routing import RoutingResult, first_chunk_replica, replay_routed
from kvtier.sim.synthetic import chat_trace
from kvtier.sim.trace import Request, parse_records


@pytest.fixture(scope="module")
def chat() -> list[Request]:
    return parse_records(enumerate(chat_trace(3), 1), "chat", limit=1500)


def test_routing_by_scores_beats_blind_routing_under_its_load_cap(chat: list[Request]) -> None:
    def run(router: str) -> RoutingResult:
        return replay_routed(chat, lambda: LRUCachePolicy(150), 8, router, slack=0.25)

    blind, hashed, scored = run("round-robin"), run("first-chunk"), run("kvtier")
    assert scored.hit_ratio > 1.2 * blind.hit_ratio
    # Hashing the system prompt piles conversations onto few replicas; the cap does not.
    assert hashed.request_peak > 1.5
    window = 8 * 8
    cap = -(-window * 1.25 // 8)
    # Over the whole trace, no replica can exceed its cap in every window.
    assert scored.request_peak <= cap / (window / 8) + 0.05
    assert sum(scored.requests_per_replica) == len(chat)


def test_a_shared_tier_serves_what_the_replicas_lack(chat: list[Request]) -> None:
    alone = replay_routed(chat, lambda: LRUCachePolicy(50), 4, "round-robin")
    shared = replay_routed(chat, lambda: LRUCachePolicy(50), 4, "round-robin", shared_capacity=2000)
    assert shared.shared_hits > 0 and shared.hit_ratio > alone.hit_ratio
    assert shared.primary_hits + shared.shared_hits <= shared.chunks


def test_first_chunk_hashing_is_stable() -> None:
    assert first_chunk_replica([7, 8], 32) == first_chunk_replica([7, 9], 32)


def test_the_command_reports_each_router_at_each_replica_count() -> None:
    result = CliRunner().invoke(
        cli,
        ["simulate", "--chat-seed", "1", "--limit", "300", "-c", "2%", "-r", "2", "-r", "4"],
    )
    assert result.exit_code == 0, result.output
    assert "kvtier" in result.output and "round-robin" in result.output
    printed = CliRunner().invoke(
        cli, ["simulate", "--chat-seed", "1", "--limit", "300", "-r", "2", "-s", "10%", "--json"]
    )
    report = json.loads(printed.output)
    assert [(row["replicas"], row["router"]) for row in report["results"]] == [
        (2, "round-robin"),
        (2, "first-chunk"),
        (2, "kvtier"),
    ]
    assert report["shared_slots"] > 0
    refused = CliRunner().invoke(
        cli, ["simulate", "--chat-seed", "1", "-r", "2", "-p", "lru", "-p", "arc"]
    )
    assert refused.exit_code == 2 and "one --policy" in refused.output
