"""Cores lent to running malleable actions (work conservation), decided each round.

A malleable action (`CostVector.malleable`: a test suite given as test cases, whose runner's
workers pull cases from a shared queue) can take more cores while it runs and give them back.
A lent core stays *free* in the `ClusterState`: the policy places queued actions on it as on any
free core, and the round then takes it back from its borrower before the allocation starts
(the worker narrows the borrower's cpuset at once; a case worker whose core went away finishes
its case on the cores left). So lending never delays a queued action, and nothing a policy
decides depends on it: only the borrowers' speed does.

`lend_cores` is the pure decision: after the round's allocations, every spare core of a node
goes to the running (or just started) malleable actions of that node, by greedy marginal gain
of their expected duration curves weighted by the share of work they have left, up to each one's
largest unit count. `idle_while_malleable` is the work-conservation invariant the simulator
(debug mode) and the unit tests check.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.resources import ClusterState

Lent = dict[str, tuple[str, frozenset[int]]]  # borrower action -> (its CPU node, cores lent)


@dataclass(frozen=True, slots=True)
class Borrower:
    """A running malleable CPU action: its action (for the duration curve and unit range) and
    its allocation (the cores it holds for good)."""

    action: QueuedAction
    alloc: Allocation


def lend_cores(
    borrowers: Iterable[Borrower],
    lent: Mapping[str, tuple[str, frozenset[int]]],
    taken: Mapping[str, set[int]],
    state: ClusterState,
    now_s: float,
    saturated: set[str] | None = None,
) -> Lent:
    """Each borrower's lent cores after this round (only the borrowers whose set changes).

    `lent`: what each borrower holds on loan now; `taken`: per node, the cores this round's
    allocations take (a lent one among them is taken back); `state`: before the allocations
    apply (lent cores are free in it). A node that is offline lends nothing. `saturated`, if
    given, gets the nodes with spare cores where no borrower would gain from one (which stays
    so until an allocation or a take-back there changes its borrowers or their loans).
    """
    by_node: dict[str, list[Borrower]] = {}
    for b in borrowers:
        if b.alloc.kind is ResourceKind.CPU and b.action.cost.malleable:
            by_node.setdefault(b.alloc.pool, []).append(b)
    out: Lent = {}
    kept: dict[str, frozenset[int]] = {}
    kept_on: dict[str, list[frozenset[int]]] = {}  # node -> its loans after the take-backs
    lent_n: dict[str, int] = {}  # node -> cores on loan there after the take-backs
    for aid, (node, ids) in lent.items():
        back = taken.get(node)
        if back and not back.isdisjoint(ids):
            ids = ids - back
            out[aid] = (node, ids)
        kept[aid] = ids
        kept_on.setdefault(node, []).append(ids)
        lent_n[node] = lent_n.get(node, 0) + len(ids)
    for node, group in by_node.items():
        cpu = state.cpu.get(node)
        if cpu is None or f"cpu:{node}" in state.offline:
            continue
        # lent and taken cores are free in `state` and disjoint: count before building sets
        if len(cpu.free) - len(taken.get(node, ())) - lent_n.get(node, 0) <= 0:
            continue
        units = {b.alloc.action_id: b.alloc.units + len(kept.get(b.alloc.action_id, ())) for b in group}
        heap: list[tuple[float, int, str]] = []
        weight: dict[str, float] = {}
        for k, b in enumerate(group):
            aid = b.alloc.action_id
            if units[aid] >= b.action.cost.units.max:
                continue  # at its largest unit count: no core would help (`_push`)
            weight[aid] = _left_share(b, state, now_s)
            _push(heap, b, units[aid], weight[aid], k)
        if not heap:  # nobody here gains from a core: no need to know which are spare
            if saturated is not None:
                saturated.add(node)
            continue
        spare = cpu.free - taken.get(node, set())
        for ids in kept_on.get(node, ()):
            spare -= ids
        grant: dict[str, list[int]] = {}
        free = sorted(spare)
        while free and heap:
            _, k, aid = heapq.heappop(heap)
            grant.setdefault(aid, []).append(free.pop())
            units[aid] += 1
            _push(heap, group[k], units[aid], weight[aid], k)
        for aid, more in grant.items():
            out[aid] = (node, kept.get(aid, frozenset()) | frozenset(more))
    return out


def _left_share(b: Borrower, state: ClusterState, now_s: float) -> float:
    """The share of its work a borrower has left, by its expected end at its own units (which
    ignores what loans sped it up: an over-estimate, never zero)."""
    total_s = b.action.duration_s(b.alloc.units)
    end_s = state.expected_end_s.get(b.alloc.action_id)
    if end_s is None or total_s <= 0:
        return 1.0
    return min(1.0, max(0.05, (end_s - now_s) / total_s))


def _push(heap: list[tuple[float, int, str]], b: Borrower, units: int, weight: float, k: int) -> None:
    """The borrower's gain from one more core (expected seconds saved on what it has left)."""
    if units >= b.action.cost.units.max:
        return
    gain = weight * (b.action.duration_s(units) - b.action.duration_s(units + 1))
    if gain > 0:
        heapq.heappush(heap, (-gain, k, b.alloc.action_id))


def idle_while_malleable(
    borrowers: Iterable[Borrower], lent: Mapping[str, tuple[str, frozenset[int]]], state: ClusterState
) -> list[str]:
    """Violations of work conservation (empty when it holds): a node with a free core that is
    not lent while a malleable action running there is below its largest unit count, and could
    still gain from one more core."""
    lent_on: dict[str, set[int]] = {}
    for node, ids in lent.values():
        lent_on.setdefault(node, set()).update(ids)
    out = []
    for b in borrowers:
        a = b.alloc
        if a.kind is not ResourceKind.CPU or not b.action.cost.malleable or a.action_id not in state.running:
            continue
        cpu = state.cpu.get(a.pool)
        if cpu is None or f"cpu:{a.pool}" in state.offline:
            continue
        idle = cpu.free - lent_on.get(a.pool, set())
        units = a.units + len(lent.get(a.action_id, ("", frozenset()))[1])
        could = units < b.action.cost.units.max and b.action.duration_s(units + 1) < b.action.duration_s(
            units
        )
        if idle and could:
            out.append(
                f"{len(idle)} idle core(s) on {a.pool} while {a.action_id} runs on {units} and could use them"
            )
    return out
