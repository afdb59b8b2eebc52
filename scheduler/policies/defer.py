"""`tangram-fast`'s reservation for cores that free up soon (EASY backfilling, per pool and round).

A running action keeps its DoP to the end, so an elastic action started on the few cores that
happen to be free can run long while many more free up seconds later. `defer_for_cores` holds
such a candidate back when waiting for more cores is worth more than what waiting costs the
actions behind it (see its docstring).
"""

from __future__ import annotations

import bisect

from scheduler.model import QueuedAction
from scheduler.policies.elastic import Member, PoolProblem


def defer_for_cores(
    problem: PoolProblem, keep: int, units: list[int], durs: list[float], free: int, checks: int = 8
) -> tuple[int, list[int]]:
    """Hold back an elastic candidate that would finish sooner by waiting for more cores.

    A running action keeps its DoP to the end, so a test suite started on the 3 cores that
    happen to be free can run for many minutes while 32 cores free up seconds later. For the
    first `checks` kept elastic candidates (FCFS order), the completion heap of the pool
    (running actions at their expected ends, overdue ones left out since nobody knows when
    they end, plus the other candidates) gives, per larger unit count u, the time t(u) at
    which u cores are free. If some t(u) + dur(u) beats now + dur(units), the candidate waits
    (0 units) and reserves u cores at t(u), EASY-backfilling style.

    Actions behind it in the pool (later candidates, and the queued rest at their minimum
    units) still start if they are expected to end by t(u), or fit in the cores free at t(u)
    beyond the reservation; the others wait, each for up to t(u) - now. The candidate waits
    only if what it gains exceeds that total delay (the objective is the sum of completion
    times), so under contention it rarely does and the round is the plain marginal-gain split,
    which maximises throughput there. Everything is re-decided next round.

    `durs[j]` is candidate j's duration at `units[j]`; `free` the pool's free cores.
    """
    now_s, members = problem.now_s, problem.members
    out = [u if j < keep else 0 for j, u in enumerate(units)]
    ends = [(now_s + durs[j], u) if u else None for j, u in enumerate(out)]
    spare = free - sum(out)
    # Expected ends of the running actions and the kept candidates, soonest first (overdue
    # ones left out: no telling when they end); j = candidate index, -1 for running ones.
    timeline = sorted(
        [(e_s, n, -1) for e_s, n in problem.busy if e_s > now_s]
        + [(e[0], e[1], j) for j, e in enumerate(ends) if e is not None and e[0] > now_s]
    )
    rest = _Rest(problem)
    for i in range(keep):
        action, u = members[i][0], out[i]
        if checks <= 0:
            break
        if u == 0 or not action.cost.units.is_elastic or u >= action.cost.units.max:
            continue
        checks -= 1
        wait = _best_wait(timeline, i, spare + u, now_s, action, u, problem.capacity)
        if wait is None or wait[0] >= ends[i][0]:  # type: ignore[index]
            continue
        done_s, t_s, extra = wait
        # Who would wait for the reservation: actions behind it that end after t and do not fit
        # in what is spare at t. Each is delayed by up to t - now; wait only if that costs less
        # than the candidate gains (the objective is the sum of completion times).
        gain_s, delay_s = ends[i][0] - done_s, t_s - now_s  # type: ignore[index]
        held, extra = _held_behind(ends, i, keep, t_s, extra, gain_s, delay_s)
        if len(held) * delay_s >= gain_s:
            continue
        n_rest, extra = rest.late(t_s, extra)
        if (len(held) + n_rest) * delay_s >= gain_s:
            continue
        for j in held:
            out[j], ends[j] = 0, None
        out[i] = 0
        _backfill(members, keep, out, spare + u, extra, now_s, t_s)
        return len(members), out  # one reservation per pool and round
    return keep, out


def _held_behind(
    ends: list[tuple[float, int] | None],
    i: int,
    keep: int,
    t_s: float,
    extra: int,
    gain_s: float,
    delay_s: float,
) -> tuple[list[int], int]:
    """The kept candidates behind candidate `i` that a reservation at `t_s` would hold back (they
    end after it and find no room in the `extra` cores spare then), and the cores still spare.
    Stops once they cost more than the reservation gains."""
    held: list[int] = []
    for j in range(i + 1, keep):
        e = ends[j]
        if e is None or e[0] <= t_s:
            continue
        if e[1] <= extra:
            extra -= e[1]
        else:
            held.append(j)
            if len(held) * delay_s >= gain_s:
                break  # already costs more than it gains: the caller's test fails anyway
    return held, extra


class _Rest:
    """The queued rest of a pool (`PoolProblem.rest`) at its minimum units: its expected ends,
    computed on first use."""

    def __init__(self, problem: PoolProblem) -> None:
        self.problem = problem
        self.ends: list[float] | None = None
        self.sorted: list[float] = []
        self.unit = True  # every one takes one core

    def late(self, t_s: float, extra: int) -> tuple[int, int]:
        """How many of the rest a reservation at `t_s` holds back (they end after it and find no
        room in the `extra` cores spare then), and the cores still spare."""
        rest = self.problem.rest
        if self.ends is None:
            now_s = self.problem.now_s
            self.ends = [now_s + dur_s for _, dur_s, _ in rest]
            self.sorted = sorted(self.ends)
            self.unit = sum(n for n, _, _ in rest) == len(rest)  # all 1 (n >= 1)
        if self.unit:  # the common case, counted by bisection: each takes one spare core or waits
            late_n = len(self.sorted) - bisect.bisect_right(self.sorted, t_s)
            return max(0, late_n - extra), max(0, extra - late_n)
        n_rest = 0
        for (n, _, _), end_s in zip(rest, self.ends, strict=True):
            if end_s <= t_s:
                continue
            if n <= extra:
                extra -= n
            else:
                n_rest += 1
        return n_rest, extra


def _backfill(
    members: list[Member],
    keep: int,
    out: list[int],
    free_now: int,
    extra: int,
    now_s: float,
    t_s: float,
) -> None:
    """Candidates the drop-tail held back start in the `free_now` cores left free now, if they
    end before `t_s`, or are rigid and fit in the `extra` cores still spare at `t_s` (an
    elastic one would be stuck at its minimum: it waits for its own turn)."""
    for j in range(keep, len(members)):
        a = members[j][0]
        n = a.cost.units.min
        late = now_s + a.duration_s(n) > t_s
        if n <= free_now and (not late or (n <= extra and not a.cost.units.is_elastic)):
            out[j] = n
            free_now -= n
            extra -= n if late else 0


def _best_wait(
    timeline: list[tuple[float, int, int]],
    skip: int,
    free: int,
    now_s: float,
    action: QueuedAction,
    units: int,
    capacity: int,
) -> tuple[float, float, int] | None:
    """(completion, start, cores spare then) of the best *later* start with more cores, if any.

    `timeline`: (end, units, candidate index) of what holds the pool's cores, soonest first;
    the entry of candidate `skip` (the one asking) is left out.
    """
    best: tuple[float, float, int] | None = None
    pos = 0
    t_s = now_s
    for u in action.cost.units.units:
        if u < 2 * units or u > capacity:
            continue  # waiting for a core or two more is not worth a reservation
        while free < u and pos < len(timeline):
            end_s, n, j = timeline[pos]
            pos += 1
            if j == skip:
                continue
            t_s = max(t_s, end_s)
            free += n
        if free < u:
            break
        if t_s <= now_s:
            continue  # free now: the marginal-gain split already weighed it against the others
        done = t_s + action.duration_s(u)
        if best is None or done < best[0]:
            best = (done, t_s, free - u)
    return best
