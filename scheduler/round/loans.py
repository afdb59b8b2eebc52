"""Core loans: the round lends the cores no allocation takes to running malleable actions.

`Loans` owns the loans and the borrowers they go to (`Round.loans`); `lend_cores`
(`scheduler.policies.malleable`) decides them. Only policies whose execution model has
`lend_cores` lend.
"""

from __future__ import annotations

from scheduler.model import Allocation, QueuedAction, ResourceKind
from scheduler.policies.malleable import Borrower, Lent, lend_cores
from scheduler.pools import CpuNode
from scheduler.queue import WaitingQueue
from scheduler.resources import ClusterState


class Loans:
    """The cores on loan and the running malleable actions they go to, kept round by round."""

    def __init__(self) -> None:
        self.lent: Lent = {}  # borrower -> (node, cores lent to it), kept by `lend`
        self._on_loan: dict[str, int] = {}  # node -> cores on loan there (`_loan`)
        self._borrowers: dict[str, Borrower] = {}  # running malleable actions (when lending)
        # the same by node, in the same order: a round looks at nodes, not at every borrower
        self._borrower_nodes: dict[str, dict[str, Borrower]] = {}
        # each node's state (object, version) when its borrowers were last looked at: a node
        # whose version has not moved has had no action end since
        self._borrowers_seen: dict[str, tuple[CpuNode, int]] = {}
        # nodes where no borrower gains from a core (each at its largest unit count or no
        # faster with one more): so until an allocation or a take-back there changes them
        self._saturated: set[str] = set()

    def lend(self, allocs: list[Allocation], queue: WaitingQueue, state: ClusterState, now_s: float) -> Lent:
        """Take lent cores back where `allocs` need them, lend the spare ones (see
        `scheduler.policies.malleable`); updates `lent` and returns the changed loans."""
        borrowers = self._borrowers
        lent = self.lent
        self._drop_ended(state)
        taken: dict[str, set[int]] = {}
        for a in allocs:
            if a.kind is ResourceKind.CPU:
                taken.setdefault(a.pool, set()).update(a.unit_ids)
                qa = queue.action(a.action_id)
                if qa.cost.malleable:
                    self._add_borrower(Borrower(qa, a))
        if not borrowers:
            return {}
        # Only nodes where something can change: an allocation took cores, or cores are spare
        # (free beyond those on loan) and a borrower there can use one. Lent cores are free in
        # `state` and disjoint.
        saturated = self._saturated
        saturated.difference_update(taken)
        on_loan = self._on_loan
        active = set(taken)
        for node in self._borrower_nodes:
            if node not in active and node not in saturated:
                cpu = state.cpu.get(node)
                if cpu is not None and len(cpu.free) > on_loan.get(node, 0):
                    active.add(node)
        if not active:
            return {}
        nodes = self._borrower_nodes
        changed = lend_cores(
            [b for node, on in nodes.items() if node in active for b in on.values()],
            {aid: loan for aid, loan in lent.items() if loan[0] in active},
            taken,
            state,
            now_s,
            saturated,
        )
        for aid, loan in changed.items():
            self._loan(aid, loan if loan[1] else None)
        return changed

    def _loan(self, aid: str, loan: tuple[str, frozenset[int]] | None) -> None:
        """Set (or with None, end) a borrower's loan, keeping the count per node."""
        lent, on_loan = self.lent, self._on_loan
        old = lent.get(aid)
        if old is not None:
            left = on_loan[old[0]] - len(old[1])
            if left:
                on_loan[old[0]] = left
            else:
                del on_loan[old[0]]
        if loan is None:
            lent.pop(aid, None)
        else:
            lent[aid] = loan  # (one already there keeps its place)
            on_loan[loan[0]] = on_loan.get(loan[0], 0) + len(loan[1])

    def borrowers(self) -> list[Borrower]:
        """The running malleable actions loans go to (as of the last round)."""
        return list(self._borrowers.values())

    def track(self, action: QueuedAction, alloc: Allocation) -> None:
        """Count a running malleable action that no round of this object started (recovered
        after a restart) as a borrower."""
        if action.cost.malleable and alloc.kind is ResourceKind.CPU:
            self._add_borrower(Borrower(action, alloc))

    def _drop_ended(self, state: ClusterState) -> None:
        """Forget the borrowers that ended (and their loans), looking only at nodes whose
        state changed since the last round."""
        seen = self._borrowers_seen
        for node, on in list(self._borrower_nodes.items()):
            cpu = state.cpu.get(node)
            last = seen.get(node)
            if cpu is not None and last is not None and last[0] is cpu and last[1] == cpu.version:
                continue
            for aid in [aid for aid in on if aid not in state.running]:
                self._drop_borrower(aid)
                self._loan(aid, None)
            if cpu is not None:
                seen[node] = (cpu, cpu.version)

    def _add_borrower(self, b: Borrower) -> None:
        aid = b.alloc.action_id
        self._saturated.discard(b.alloc.pool)
        old = self._borrowers.get(aid)
        if old is not None and old.alloc.pool != b.alloc.pool:
            self._uncount(old.alloc.pool, aid)
        self._borrowers[aid] = b  # (one already there keeps its place: loans go in this order)
        self._borrower_nodes.setdefault(b.alloc.pool, {})[aid] = b

    def _drop_borrower(self, aid: str) -> None:
        self._uncount(self._borrowers.pop(aid).alloc.pool, aid)

    def _uncount(self, node: str, aid: str) -> None:
        on = self._borrower_nodes[node]
        del on[aid]
        if not on:
            del self._borrower_nodes[node]
            self._borrowers_seen.pop(node, None)
            self._saturated.discard(node)
