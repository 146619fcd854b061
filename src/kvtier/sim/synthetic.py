"""A generated multi-turn chat trace, for tests and for policies to be judged on.

Conversations open at Poisson arrivals, each on one of a few shared system
prompts (Zipf-popular), and run a geometric number of turns. Every turn's
prompt is the whole conversation so far plus a new user message, so it
reuses all of the previous turn's full blocks; the partial last block is
hashed fresh each time, as in Mooncake's traces. Requests of different
conversations interleave in time.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class ChatShape:
    """What the generated workload looks like; the defaults are a busy chat service."""

    conversations: int = 2000
    block_size: int = 256
    system_prompts: int = 8
    system_tokens: tuple[int, int] = (300, 3000)
    mean_turns: float = 4.0
    user_tokens: float = 250.0
    output_tokens: float = 350.0
    #: Mean seconds between conversations opening, and between a reply and the next turn.
    arrival_s: float = 0.5
    think_s: float = 40.0


def parse_chat_shape(fields: Iterable[str], base: ChatShape = ChatShape()) -> ChatShape:
    """``base`` with fields changed by ``FIELD=VALUE`` texts (``system_tokens=300-3000``).

    Raises ``ValueError`` naming the text for an unknown field (listing the
    valid ones), a value of the wrong kind, or one out of range.
    """
    types = {field.name: type(getattr(base, field.name)) for field in dataclasses.fields(base)}
    changes: dict[str, object] = {}
    for text in fields:
        name, sep, value = text.partition("=")
        name = name.strip()
        if not sep or name not in types:
            raise ValueError(
                f"{text!r} is not FIELD=VALUE with FIELD one of {', '.join(sorted(types))}"
            )
        try:
            if types[name] is tuple:
                low, high = (int(part) for part in value.split("-"))
                if not 0 < low <= high:
                    raise ValueError
                changes[name] = (low, high)
            else:
                number = types[name](value)
                if not 0 < number < math.inf:
                    raise ValueError
                changes[name] = number
        except ValueError:
            kind = "LOW-HIGH, 0 < LOW <= HIGH" if types[name] is tuple else "a positive number"
            raise ValueError(f"{text!r}: {name} must be {kind}") from None
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def chat_trace(seed: int, shape: ChatShape = ChatShape()) -> list[dict[str, object]]:
    """Requests in Mooncake's format (timestamp in ms), sorted by arrival, each naming
    its ``block_size`` as kvtier's recorder does."""
    rng = random.Random(seed)
    block = shape.block_size
    prompts = [rng.randint(*shape.system_tokens) for _ in range(shape.system_prompts)]
    weights = [1 / (rank + 1) for rank in range(shape.system_prompts)]
    ids = _Ids()
    # (arrival, conversation, turn, system prompt, tokens so far, turns left)
    pending: list[tuple[float, int, int, int, int, int]] = []
    opened = 0.0
    for conversation in range(shape.conversations):
        opened += rng.expovariate(1 / shape.arrival_s)
        prompt = rng.choices(range(shape.system_prompts), weights)[0]
        turns = 1 + int(rng.expovariate(1 / max(shape.mean_turns - 1, 1e-9)))
        heapq.heappush(pending, (opened, conversation, 0, prompt, prompts[prompt], turns))
    records: list[dict[str, object]] = []
    while pending:
        at, conversation, turn, prompt, history, turns = heapq.heappop(pending)
        length = history + max(1, int(rng.expovariate(1 / shape.user_tokens)))
        output = max(1, int(rng.expovariate(1 / shape.output_tokens)))
        shared = prompts[prompt] // block  # blocks wholly inside the system prompt
        hash_ids = [
            ids.of(("system", prompt, index) if index < shared else ("chat", conversation, index))
            for index in range(length // block)
        ]
        if length % block:
            hash_ids.append(ids.fresh())
        records.append(
            {
                "timestamp": int(at * 1000),
                "input_length": length,
                "output_length": output,
                "hash_ids": hash_ids,
                "block_size": block,
            }
        )
        if turn + 1 < turns:
            again = at + rng.expovariate(1 / shape.think_s)
            heapq.heappush(pending, (again, conversation, turn + 1, prompt, length + output, turns))
    return records


class _Ids:
    """Small integer ids for block identities, as trace files carry."""

    def __init__(self) -> None:
        self._ids: dict[tuple[object, ...], int] = {}

    def of(self, identity: tuple[object, ...]) -> int:
        return self._ids.setdefault(identity, len(self._ids))

    def fresh(self) -> int:
        return self.of(("fresh", len(self._ids)))
