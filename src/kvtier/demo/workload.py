"""The demo's workload: multi-turn chats that share one long system prompt.

Every conversation starts with the same system prompt; each turn appends a
user message to the conversation so far (the model's earlier replies
included) and generates a greedy reply. The same requests run three times:

1. without kvtier: every prompt is prefilled in full;
2. through kvtier: a request reuses the chunks earlier requests stored;
3. through kvtier with the CPU tier emptied before each request, so every
   reused chunk comes from a secondary tier.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.demo.model import Tokenizer
from kvtier.integrations.transformers import Generation, PrefixCache, greedy_generate

_SUBJECTS = (
    "the cache",
    "a tenant",
    "the scheduler",
    "every replica",
    "the storage tier",
    "an operator",
    "the request router",
    "a shared prefix",
    "the billing service",
    "the audit log",
)
_VERBS = (
    "must record",
    "may evict",
    "should verify",
    "never discards",
    "promotes",
    "reports",
    "keeps",
    "compresses",
    "checks",
    "rebuilds",
)
_OBJECTS = (
    "idle chunks before noon",
    "the checksum of each record",
    "stale entries older than a day",
    "every failed transfer",
    "the namespace of the model",
    "its quota in whole gigabytes",
    "requests from unknown regions",
    "the last known good snapshot",
    "the latency of each tier",
    "tokens that share a prefix",
)
_QUESTIONS = (
    "How long do you keep chunks that nobody reads?",
    "What happens when a tier fails in the middle of a transfer?",
    "Can two engines share the same cache directory?",
    "Which requests get served first when the disk is busy?",
    "Why would a corrupt chunk never reach the model?",
    "How do I size the CPU tier for a long system prompt?",
    "What does a cache hit save compared with a full prefill?",
    "Is my data kept apart from other tenants' data?",
)

SYSTEM_HEADER = (
    "You are Tern, the support assistant of Northwind Storage. Answer briefly and "
    "follow the operating rules below exactly.\n\nOperating rules:\n"
)


@dataclass(frozen=True)
class ChatWorkload:
    """Token ids of a deterministic chat workload."""

    #: The shared system prompt.
    system: list[int]
    #: ``user_turns[c][t]``: conversation ``c``'s message at turn ``t``, role markers included.
    user_turns: list[list[list[int]]]
    new_tokens: int
    eos_token_id: int | None = None

    @property
    def conversations(self) -> int:
        return len(self.user_turns)

    @property
    def turns(self) -> int:
        return len(self.user_turns[0]) if self.user_turns else 0

    @property
    def requests(self) -> int:
        return self.conversations * self.turns

    @property
    def longest_sequence(self) -> int:
        """Most tokens one conversation can reach: every turn's prompt and full reply."""
        return max(
            len(self.system) + sum(len(turn) for turn in turns) + len(turns) * self.new_tokens
            for turns in self.user_turns
        )


def chat_workload(
    tokenizer: Tokenizer,
    *,
    system_tokens: int,
    conversations: int,
    turns: int,
    new_tokens: int,
    seed: int = 0,
) -> ChatWorkload:
    """Build a workload whose system prompt is exactly ``system_tokens`` tokens."""
    if min(system_tokens, conversations, turns, new_tokens) < 1:
        raise ValueError("system_tokens, conversations, turns and new_tokens must be positive")
    rng = random.Random(seed)
    system = tokenizer.encode(SYSTEM_HEADER)
    rule = 1
    while len(system) < system_tokens:
        sentence = f"{rule}. {rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} "
        sentence += f"{rng.choice(_OBJECTS)}, unless {rng.choice(_SUBJECTS)} "
        sentence += f"{rng.choice(_VERBS)} {rng.choice(_OBJECTS)}.\n"
        encoded = tokenizer.encode(sentence)
        if not encoded:
            raise ValueError("the tokenizer encodes text to no tokens; is it a real tokenizer?")
        system += encoded
        rule += 1
    user_turns = [
        [tokenizer.encode(f"\nUser: {rng.choice(_QUESTIONS)}\nAssistant:") for _ in range(turns)]
        for _ in range(conversations)
    ]
    return ChatWorkload(system[:system_tokens], user_turns, new_tokens, tokenizer.eos_token_id)


@dataclass(frozen=True)
class RequestRecord:
    """One request of one phase, and what kvtier did for it."""

    conversation: int
    turn: int
    prompt_tokens: int
    #: Full chunks of the prompt: what kvtier could hold of it.
    full_chunks: int
    hit_chunks: int
    reused_tokens: int
    #: Per secondary tier: chunks it served.
    promoted_chunks: tuple[int, ...]
    stored_chunks: int
    ttft_s: float
    tokens: list[int] = field(repr=False)

    @property
    def primary_hit_chunks(self) -> int:
        return self.hit_chunks - sum(self.promoted_chunks)

    def source(self, tier_types: list[str]) -> str:
        """Where the reused prefix came from: ``miss``; ``CPU``; a secondary tier's type
        (the slowest one used) when the CPU tier had none of it; ``CPU+type`` when both served."""
        if self.reused_tokens == 0:
            return "miss"
        used = [index for index, chunks in enumerate(self.promoted_chunks) if chunks]
        if not used:
            return "CPU"
        slowest = tier_types[used[-1]]
        return f"CPU+{slowest}" if self.primary_hit_chunks else slowest


def run_phase(
    workload: ChatWorkload,
    generate: Callable[[list[int]], Generation],
    *,
    chunk_tokens: int,
    before_request: Callable[[], None] | None = None,
    after_request: Callable[[], None] | None = None,
) -> list[RequestRecord]:
    """Run every request, turn by turn across conversations, as users would arrive."""
    history = [list(workload.system) for _ in range(workload.conversations)]
    records = []
    for turn in range(workload.turns):
        for conversation in range(workload.conversations):
            prompt = history[conversation] + workload.user_turns[conversation][turn]
            if before_request is not None:
                before_request()
            result = generate(prompt)
            history[conversation] = prompt + result.tokens
            records.append(
                RequestRecord(
                    conversation=conversation,
                    turn=turn,
                    prompt_tokens=len(prompt),
                    full_chunks=len(prompt) // chunk_tokens,
                    hit_chunks=result.hit_tokens // chunk_tokens,
                    reused_tokens=result.reused_tokens,
                    promoted_chunks=result.promoted_chunks,
                    stored_chunks=result.stored_chunks,
                    ttft_s=result.ttft_s,
                    tokens=result.tokens,
                )
            )
            if after_request is not None:
                after_request()
    return records


@dataclass
class DemoRun:
    """The three phases of the demo, run on one model and one kvtier configuration."""

    baseline: list[RequestRecord]
    kvtier: list[RequestRecord]
    #: Phase 3; ``None`` when the configuration has no secondary tier.
    refetch: list[RequestRecord] | None

    def mismatches(self) -> list[tuple[str, int]]:
        """``(phase, request index)`` of every reply that differs from the baseline's."""
        phases = [("kvtier", self.kvtier), ("secondary tier", self.refetch or [])]
        return [
            (name, index)
            for name, records in phases
            for index, (record, reference) in enumerate(zip(records, self.baseline, strict=False))
            if record.tokens != reference.tokens
        ]


def run_demo(
    kv: PrefixCache,
    workload: ChatWorkload,
    *,
    on_phase: Callable[[str, int], None] | None = None,
    on_request: Callable[[], None] | None = None,
) -> DemoRun:
    """Run the workload without kvtier, through kvtier, then from the secondary tiers."""
    model, chunk_tokens = kv.model, kv.chunk_tokens

    def baseline(prompt: list[int]) -> Generation:
        return greedy_generate(
            model, prompt, workload.new_tokens, eos_token_id=workload.eos_token_id
        )

    def cached(prompt: list[int]) -> Generation:
        return kv.generate(prompt, workload.new_tokens, eos_token_id=workload.eos_token_id)

    # Warm up at the longest prompt length the workload starts with, so the first
    # timed request (the baseline's) pays no one-off allocation or kernel costs.
    greedy_generate(model, workload.system, 2)

    def phase(
        name: str,
        generate: Callable[[list[int]], Generation],
        before_request: Callable[[], None] | None = None,
    ) -> list[RequestRecord]:
        if on_phase is not None:
            on_phase(name, workload.requests)
        return run_phase(
            workload,
            generate,
            chunk_tokens=chunk_tokens,
            before_request=before_request,
            after_request=on_request,
        )

    first = phase("full prefill, no kvtier", baseline)
    second = phase("through kvtier", cached)
    third = None
    if kv.kv.status.tiers:
        third = phase("through kvtier, CPU tier emptied first", cached, kv.kv.reset)
    return DemoRun(first, second, third)
