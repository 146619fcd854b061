"""The parts the tier runtime composes, each on its own: the workers' order,
the existence checks' answers, the jobs' results, and guards chosen by options."""

from __future__ import annotations

import functools
import random
import threading

from kvtier.keys import ChunkKey
from kvtier.testing import TierHarness, small_layout
from kvtier.tiers.base import Lookup, LookupContext, TransferJob
from kvtier.tiers.checks import ExistenceChecks
from kvtier.tiers.jobs import Jobs, JobState
from kvtier.tiers.memory import MemoryTier
from kvtier.tiers.workers import Priority, Workers
from tests.tiers.remote.remote_doubles import FreezableTier

KEYS = [ChunkKey(bytes([i]) * 16) for i in range(4)]


def test_workers_take_held_loads_then_checks_then_loads_then_stores() -> None:
    workers = Workers("kvtier-parts", 1)
    started, gate = threading.Event(), threading.Event()
    ran: list[Priority] = []

    def hold() -> None:  # the only worker, held while the rest queue
        started.set()
        gate.wait(30)

    workers.submit(Priority.STORE, hold)
    assert started.wait(30)
    for priority in (Priority.STORE, Priority.LOAD, Priority.CHECK, Priority.HELD):
        workers.submit(priority, functools.partial(ran.append, priority))
    assert workers.backlog() == 4
    gate.set()
    workers.stop(timeout=30)
    assert ran == [Priority.HELD, Priority.CHECK, Priority.LOAD, Priority.STORE]
    assert workers.stopped and not any(t.is_alive() for t in workers.threads)


def test_an_existence_answer_is_taken_once_and_a_failing_key_gives_up() -> None:
    checks = ExistenceChecks(attempts=2, max_answers=16)
    assert checks.answer(KEYS[0]) is Lookup.PENDING
    assert checks.answer(KEYS[0]) is Lookup.PENDING  # one check for both lookups
    assert checks.take_queued() == [KEYS[0]] and checks.checking == {KEYS[0]}
    checks.record([KEYS[0]], [True])
    assert checks.answer(KEYS[0]) is Lookup.HIT
    assert checks.answer(KEYS[0]) is Lookup.PENDING  # consumed: asked again
    for _ in range(2):
        checks.take_queued()
        checks.record([KEYS[0]], [None])  # the backend could not say
    assert checks.answer(KEYS[0]) is Lookup.MISS


def test_a_run_of_answers_ends_at_its_first_miss_and_asks_nothing_past_it() -> None:
    checks = ExistenceChecks(attempts=3, max_answers=16)
    checks.answer(KEYS[1])
    checks.answer(KEYS[2])
    checks.answer(KEYS[3])
    checks.take_queued()
    checks.record(KEYS[1:], [True, False, True])
    assert checks.answer_run(KEYS) == [Lookup.PENDING, Lookup.HIT, Lookup.MISS]
    assert checks.take_queued() == [KEYS[0]]  # no check queued past the miss...
    assert checks.answer(KEYS[3]) is Lookup.HIT  # ...nor its HIT taken
    assert checks.answer_run(KEYS[:1]) == [Lookup.PENDING]  # still being checked
    assert checks.take_queued() == []


def _answers_one_by_one(checks: ExistenceChecks, keys: list[ChunkKey]) -> list[Lookup]:
    """What :meth:`ExistenceChecks.answer_run` must give: :meth:`answer` of each
    key in turn, up to the first MISS."""
    answers = []
    for key in keys:
        answers.append(checks.answer(key))
        if answers[-1] is Lookup.MISS:
            break
    return answers


def _check_state(checks: ExistenceChecks) -> tuple[object, ...]:
    return (
        checks.queued,
        checks.checking,
        dict(checks._found),
        dict(checks._missing),
        set(checks._overdue),
        dict(checks._failed),
    )


def test_a_run_answers_and_queues_as_its_keys_asked_one_by_one_would() -> None:
    # answer_run takes whole runs at once where no key has an answer yet, or
    # every key is being checked: in any state, it must do what answer() of
    # each key would, to the same answers and the same checks queued.
    pool = [ChunkKey(bytes([i]) * 16) for i in range(12)]
    rng = random.Random(7)
    now = [0.0]
    for _ in range(300):
        run_checks, key_checks = (
            ExistenceChecks(attempts=2, max_answers=64, clock=lambda: now[0]) for _ in range(2)
        )
        for _ in range(rng.randrange(12)):  # the same history for both
            keys = rng.sample(pool, rng.randrange(1, 6))
            step = rng.randrange(4)
            found = [rng.choice([True, False, None]) for _ in keys]
            for checks in (run_checks, key_checks):
                if step == 0:
                    _answers_one_by_one(checks, keys)
                elif step == 1:  # checks of the keys being checked answer
                    checks.take_queued()
                    answered = [
                        (k, f) for k, f in zip(keys, found, strict=True) if k in checks.checking
                    ]
                    checks.record([k for k, _ in answered], [f for _, f in answered])
                elif step == 2:
                    checks.overdue(keys)
                else:
                    checks.forget(keys)
            now[0] += rng.choice([0.0, 0.5, 2.0])
            # What answering a key being checked at once rests on.
            for key in run_checks.checking:
                assert key not in run_checks._found and key not in run_checks._missing
                assert run_checks._failed.get(key, 0) < run_checks.attempts
        assert _check_state(run_checks) == _check_state(key_checks)
        run = [rng.choice(pool) for _ in range(rng.randrange(1, 8))]  # repeats too
        assert run_checks.answer_run(run) == _answers_one_by_one(key_checks, run), run
        assert _check_state(run_checks) == _check_state(key_checks)


def test_a_tier_answers_a_run_of_the_keys_its_index_knows_or_of_those_it_does_not() -> None:
    harness = TierHarness({"type": "memory"}, small_layout(), tier_class=MemoryTier)
    try:
        tier = harness.tier
        # An index that knows KEYS[0] is there, KEYS[1] is not, and nothing else.
        index = {KEYS[0]: True, KEYS[1]: False}
        tier.store.known = lambda key: index.get(key)  # type: ignore[method-assign]
        ctx = LookupContext()
        assert tier.lookup_run(KEYS, ctx) == [Lookup.HIT, Lookup.MISS]
        assert tier.lookup_run([KEYS[0], KEYS[0]], ctx) == [Lookup.HIT, Lookup.HIT]
        assert tier.checks.queued == ()
        assert tier.lookup_run(KEYS[2:], ctx) == [Lookup.PENDING, Lookup.PENDING]
        assert tier.checks.queued == tuple(KEYS[2:])
        # A run is of one kind: the keys the index knows end one it does not.
        assert tier.lookup_run([KEYS[2], KEYS[0]], ctx) == [Lookup.PENDING]
        assert tier.lookup_run([KEYS[0], KEYS[3]], ctx) == [Lookup.HIT]
    finally:
        harness.close()


def test_a_miss_answers_every_lookup_for_a_while_unless_the_key_is_stored() -> None:
    now = [0.0]
    checks = ExistenceChecks(attempts=3, max_answers=16, miss_answer_s=1.0, clock=lambda: now[0])
    assert checks.answer(KEYS[0]) is Lookup.PENDING
    checks.take_queued()
    checks.record([KEYS[0]], [False])
    now[0] = 1.0
    assert checks.answer(KEYS[0]) is Lookup.MISS
    assert checks.answer(KEYS[0]) is Lookup.MISS  # not consumed
    now[0] = 1.5
    assert checks.answer(KEYS[0]) is Lookup.PENDING  # too old: checked again
    assert checks.take_queued() == [KEYS[0]]
    checks.record([KEYS[0]], [False])
    assert checks.answer(KEYS[0]) is Lookup.MISS
    checks.forget([KEYS[0]])  # being stored: the MISS no longer holds
    assert checks.answer(KEYS[0]) is Lookup.PENDING


def test_a_check_past_its_deadline_answers_miss_until_it_ends() -> None:
    checks = ExistenceChecks(attempts=3, max_answers=16)
    checks.answer(KEYS[1])
    checks.overdue([KEYS[1], KEYS[2]])  # KEYS[2] is not being checked: left alone
    assert checks.answer(KEYS[1]) is Lookup.MISS
    assert checks.answer(KEYS[1]) is Lookup.MISS
    assert checks.answer(KEYS[2]) is Lookup.PENDING
    checks.record([KEYS[1]], [True])
    assert checks.answer(KEYS[1]) is Lookup.HIT


def test_a_job_reports_its_batches_and_the_keys_found_gone() -> None:
    progressed: list[int] = []
    jobs = Jobs(chunk_bytes=10, on_progress=lambda: progressed.append(1))
    state = JobState(TransferJob(keys=tuple(KEYS[:3]), slots=(0, 1, 2)), loading=True)
    jobs.open(state, batches=2)
    jobs.batch_done(state, KEYS[:2], [True, True])
    jobs.vanished(KEYS[2])
    assert jobs.take_finished() == [] and jobs.in_flight() == [state.job.job_id]
    jobs.batch_done(state, KEYS[2:3], [False])
    [result] = jobs.take_finished()
    assert not result.success and result.succeeded == frozenset(KEYS[:2])
    assert result.nbytes == 20 and result.vanished == frozenset(KEYS[2:3])
    assert progressed and jobs.in_flight() == []
    jobs.drain(timeout=0)


def test_a_job_answered_early_ignores_its_late_batches() -> None:
    jobs = Jobs(chunk_bytes=10, on_progress=lambda: None)
    state = JobState(TransferJob(keys=tuple(KEYS[:2]), slots=(0, 1)), loading=False)
    jobs.open(state, batches=2)
    jobs.batch_done(state, KEYS[:1], [True])
    assert jobs.answer_early(state.job.job_id) is state
    assert jobs.answer_early(state.job.job_id) is None  # once
    jobs.batch_done(state, KEYS[1:2], [True])  # late: its slots are no longer the tier's
    [result] = jobs.take_finished()
    assert result.succeeded == frozenset(KEYS[:1])
    assert jobs.take_finished() == []


def test_guards_come_with_options_that_configure_them() -> None:
    local = TierHarness({"type": "memory"}, small_layout(), tier_class=MemoryTier)
    remote = TierHarness(
        {"type": "FreezableTier", "module_path": "tests.tiers.remote.remote_doubles"},
        small_layout(),
        tier_class=FreezableTier,
    )
    try:
        assert local.tier.guards is None  # LocalTier: its options configure none
        guards = remote.tier.guards  # RemoteTierOptions: breaker, deadlines, budgets
        assert guards is not None and guards.breaker is remote.tier.breaker
        assert guards.deadline_s == remote.tier.options.deadline_s
    finally:
        local.close()
        remote.close()


def test_names_a_backend_reports_dropped_reach_residency_as_keys_of_this_namespace() -> None:
    entry = {"type": "FreezableTier", "module_path": "tests.tiers.remote.remote_doubles"}
    harness = TierHarness(entry, small_layout(), tier_class=FreezableTier)
    removed: list[ChunkKey] = []
    harness.tier.removal_listeners.append(removed.extend)
    try:
        keys = harness.keys(4)
        store = harness.tier.store  # what the backend holds as its runtime
        ours = [harness.tier.store_name(key) for key in keys[:2]]
        foreign = [
            "t:" + "0" * 64 + ":" + keys[2].hex(),  # another namespace's
            store.names_prefix + keys[3].hex()[:-2],  # cut short
            store.names_prefix + "zz" * 16,  # not hex
            store.names_prefix + " " + keys[3].hex()[1:],  # hex with a space in it
            keys[3].hex(),  # no prefix at all
        ]
        store.report_removed([ours[0], *foreign, ours[1].encode()])  # some stores list bytes
        assert removed == keys[:2]
    finally:
        harness.close()


def test_a_job_answered_while_a_worker_touches_its_slots_reports_once_it_leaves() -> None:
    jobs = Jobs(chunk_bytes=8, on_progress=lambda: None)
    keys = KEYS[:2]
    state = JobState(TransferJob(tuple(keys), (0, 1)), loading=True)
    jobs.open(state, batches=2)
    with jobs.touching_slots(state) as allowed:
        assert allowed
        assert jobs.answer_early(state.job.job_id) is state  # at its deadline
        assert jobs.take_finished() == []  # not while the worker may still write
        with jobs.touching_slots(state) as late:
            assert not late  # no worker starts after the answer
        assert jobs.answer_early(state.job.job_id) is None  # answered once
    [result] = jobs.take_finished()
    assert not result.success and state.reported
    with jobs.touching_slots(state) as after:
        assert not after
    jobs.batch_done(state, keys[:1], [True])  # a batch ending now changes nothing
    assert jobs.take_finished() == [] and result.succeeded == frozenset()
