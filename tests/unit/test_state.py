"""The lifecycle table: every move it allows, every move it refuses, and where each one ends."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable

import pytest

from ckptdrain.daemon.state import (
    INITIAL_GENERATION,
    INITIAL_RANK,
    INITIAL_SHARD,
    TERMINAL_GENERATION,
    TERMINAL_RANK,
    TERMINAL_SHARD,
    TRANSITIONS,
    UNDRAINED_SHARD,
    Event,
    GenerationEvent,
    GenerationState,
    IllegalTransition,
    RankEvent,
    RankState,
    ShardEvent,
    ShardState,
    State,
    journalled,
    settled,
    transition,
)

S, SE, R, RE, G, GE = ShardState, ShardEvent, RankState, RankEvent, GenerationState, GenerationEvent

# The table written out once more, by hand: a change to the lifecycle must change both.
EXPECTED: dict[tuple[State, Event], State] = {
    (S.HELD, SE.STAGED): S.STAGED,
    (S.HELD, SE.DISCARDED): S.DISCARDED,
    (S.STAGED, SE.DRAIN_STARTED): S.DRAINING,
    (S.STAGED, SE.DISCARDED): S.DISCARDED,
    (S.DRAINING, SE.DRAINED): S.DRAINED,
    (S.DRAINING, SE.DRAIN_GAVE_UP): S.STAGED,
    (S.DRAINING, SE.DRAIN_FAILED): S.FAILED,
    (S.DRAINING, SE.DISCARDED): S.DISCARDED,
    (S.DRAINED, SE.DISCARDED): S.DISCARDED,
    (S.FAILED, SE.RETRIED): S.STAGED,
    (S.DRAINED, SE.VANISHED): S.FAILED,
    (S.FAILED, SE.DISCARDED): S.DISCARDED,
    (R.OPEN, RE.SEALED): R.SEALED,
    (R.OPEN, RE.ABORTED): R.ABORTED,
    (R.SEALED, RE.RECORDED): R.RECORDED,
    (R.SEALED, RE.ABORTED): R.ABORTED,
    (R.RECORDED, RE.ABORTED): R.ABORTED,
    (G.OPEN, GE.RECORDED): G.RECORDED,
    (G.OPEN, GE.COMMITTED): G.COMMITTED,
    (G.OPEN, GE.FAILED): G.FAILED,
    (G.OPEN, GE.PEER_ABORTED): G.FAILED,
    (G.OPEN, GE.CANCELLED): G.CANCELLED,
    (G.RECORDED, GE.REOPENED): G.OPEN,
    (G.RECORDED, GE.COMMITTED): G.COMMITTED,
    (G.RECORDED, GE.FAILED): G.FAILED,
    (G.RECORDED, GE.PEER_ABORTED): G.FAILED,
    (G.RECORDED, GE.EXPIRED): G.FAILED,
    (G.RECORDED, GE.CANCELLED): G.CANCELLED,
    (G.RECORDED, GE.SUPERSEDED_BY_COMMIT): G.CANCELLED,
    (G.FAILED, GE.RETRIED): G.OPEN,
    (G.FAILED, GE.COMMITTED): G.COMMITTED,
}

LIFECYCLES: list[tuple[type[State], type[Event], Iterable[State], frozenset[State]]] = [
    (ShardState, ShardEvent, INITIAL_SHARD, TERMINAL_SHARD),
    (RankState, RankEvent, [INITIAL_RANK], TERMINAL_RANK),
    (GenerationState, GenerationEvent, [INITIAL_GENERATION], TERMINAL_GENERATION),
]
ALL_STATES: list[State] = [s for states, *_ in LIFECYCLES for s in states]
ALL_EVENTS: list[Event] = [e for _, events, *_ in LIFECYCLES for e in events]
# Out of an ended state only on an operator's word (`ckptdrain retry`, `ckptdrain abort`), or
# on a manifest holding this node's part of a step that failed here.
EXITS_FROM_ENDED = {(G.FAILED, GE.RETRIED), (R.RECORDED, RE.ABORTED), (G.FAILED, GE.COMMITTED)}


def test_the_table_is_exactly_the_expected_one() -> None:
    assert TRANSITIONS == EXPECTED
    assert len(TRANSITIONS) == len(EXPECTED)


@pytest.mark.parametrize(("state", "event"), list(EXPECTED), ids=lambda v: v.name)
def test_every_entry_moves_where_the_table_says(state: State, event: Event) -> None:
    new = transition(state, event)
    assert new is EXPECTED[(state, event)]
    assert type(new) is type(state)


def test_every_entry_stays_in_its_own_lifecycle() -> None:
    for (state, event), new in TRANSITIONS.items():
        kind = next(st for st, ev, *_ in LIFECYCLES if isinstance(event, ev))
        assert isinstance(state, kind) and isinstance(new, kind), (state, event, new)


def missing_pairs() -> list[tuple[State, Event]]:
    return [(s, e) for s, e in itertools.product(ALL_STATES, ALL_EVENTS)
            if not any(k[0] is s and k[1] is e for k in EXPECTED)]


def test_every_missing_key_raises_naming_state_and_event() -> None:
    pairs = missing_pairs()
    # Every state against every event of every lifecycle, minus the allowed moves.
    assert len(pairs) == len(ALL_STATES) * len(ALL_EVENTS) - len(EXPECTED)
    for state, event in pairs:
        with pytest.raises(IllegalTransition) as info:
            transition(state, event)
        message = str(info.value)
        assert event.name in message and state.name in message, message
        assert type(state).__name__ in message and type(event).__name__ in message


def test_a_state_of_another_lifecycle_with_the_same_value_is_refused() -> None:
    # "open" and "recorded" are states of ranks and generations alike: the table must still
    # never let a rank take a generation's move, nor take a bare string for a state.
    assert R.OPEN == G.OPEN
    with pytest.raises(IllegalTransition):
        transition(R.OPEN, GE.RECORDED)
    with pytest.raises(IllegalTransition):
        transition(G.RECORDED, RE.ABORTED)
    with pytest.raises(IllegalTransition):
        transition("open", GE.RECORDED)


def exits(state: State) -> list[Event]:
    return [e for (s, e) in TRANSITIONS if s is state]


def test_every_state_but_a_terminal_one_has_a_way_out() -> None:
    for states, _, _, terminal in LIFECYCLES:
        for state in states:
            if state in terminal:
                allowed = {(state, e) for e in exits(state)}
                assert allowed <= EXITS_FROM_ENDED, f"{state!r} is terminal but has {allowed}"
            else:
                assert exits(state), f"{state!r} has no way out"


def test_every_state_is_reachable_from_where_its_lifecycle_begins() -> None:
    for states, _, initial, _ in LIFECYCLES:
        seen = set(initial)
        frontier = list(initial)
        while frontier:
            state = frontier.pop()
            for event in exits(state):
                new = TRANSITIONS[(state, event)]
                if new not in seen:
                    seen.add(new)
                    frontier.append(new)
        assert seen == set(states), f"unreachable: {set(states) - seen}"


def test_terminal_generations_are_the_ended_ones() -> None:
    assert {G.COMMITTED, G.FAILED, G.CANCELLED} == TERMINAL_GENERATION
    assert {S.DISCARDED} == TERMINAL_SHARD
    assert {R.RECORDED, R.ABORTED} == TERMINAL_RANK


def test_undrained_shards_are_the_ones_this_node_still_answers_for() -> None:
    assert {S.HELD, S.STAGED, S.DRAINING, S.FAILED} == UNDRAINED_SHARD
    assert S.DRAINED not in UNDRAINED_SHARD and S.DISCARDED not in UNDRAINED_SHARD


@pytest.mark.parametrize("state", list(ShardState), ids=str)
def test_settled_shards_are_drained_or_deferred_with_a_known_checksum(state: ShardState) -> None:
    assert settled(state, deferred=False, has_checksum=False) is (state is S.DRAINED)
    assert settled(state, deferred=False, has_checksum=True) is (state is S.DRAINED)
    assert settled(state, deferred=True, has_checksum=True) is (state in (S.STAGED, S.DRAINED))
    assert settled(state, deferred=True, has_checksum=False) is False


def test_a_draining_shard_is_journalled_as_staged() -> None:
    assert journalled(S.DRAINING) is S.STAGED
    for state in ShardState:
        if state is not S.DRAINING:
            assert journalled(state) is state


def test_a_move_with_several_events_has_a_plain_one_named_for_its_target() -> None:
    # The old target-state setters map (state, target) back to an event: where several
    # events lead there (why it failed or was cancelled), the plain one must be among them.
    by_move: dict[tuple[State, State], list[Event]] = {}
    for (state, event), new in TRANSITIONS.items():
        by_move.setdefault((state, new), []).append(event)
    for (state, new), events in by_move.items():
        if len(events) > 1:
            assert [e.name for e in events].count(new.name) == 1, (state, new, events)


@pytest.mark.parametrize("seed", range(20))
def test_random_walks_stay_in_the_enum_and_never_leave_an_ended_state(seed: int) -> None:
    rng = random.Random(seed)
    for states, events, initial, terminal in LIFECYCLES:
        for start in initial:
            state: State = start
            for _ in range(200):
                event = rng.choice(list(events))
                try:
                    new = transition(state, event)
                except IllegalTransition:
                    assert (state, event) not in TRANSITIONS
                    continue
                assert new in list(states)
                if state in terminal:
                    assert (state, event) in EXITS_FROM_ENDED, f"left {state!r} by {event!r}"
                state = new
