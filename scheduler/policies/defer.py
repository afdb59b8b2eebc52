"""`tangram-fast`'s reservation for cores that free up soon (EASY backfilling, per pool and round).

A running action keeps its DoP to the end, so an elastic action started on the few cores that
happen to be free can run long while many more free up seconds later. `defer_for_cores` holds
such a candidate back when waiting for more cores is worth more than what waiting costs the
actions behind it (see its docstring).
"""

from __future__ import annotations

import bisect

from scheduler.model import QueuedAction
from scheduler.policies.elastic import PoolProblem


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
    rest_ends: list[float] | None = None  # the queued rest's ends at minimum units, if needed
    rest_sorted: list[float] = []
    rest_unit = True
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
        held: list[int] = []
        gain_s, delay_s = ends[i][0] - done_s, t_s - now_s  # type: ignore[index]
        for j in range(i + 1, keep):
            e = ends[j]
            if e is None or e[0] <= t_s:
                continue
            if e[1] <= extra:
                extra -= e[1]
            else:
                held.append(j)
                if len(held) * delay_s >= gain_s:
                    break  # already costs more than it gains: the test below fails anyway
        if len(held) * delay_s >= gain_s:
            continue
        if rest_ends is None:
            rest_ends = [now_s + dur_s for _, dur_s, _ in problem.rest]
            rest_sorted = sorted(rest_ends)
            rest_unit = sum(n for n, _, _ in problem.rest) == len(problem.rest)  # all 1 (n >= 1)
        if rest_unit:  # the common case, counted by bisection: each takes one spare core or waits
            late_n = len(rest_sorted) - bisect.bisect_right(rest_sorted, t_s)
            n_rest = max(0, late_n - extra)
            extra = max(0, extra - late_n)
        else:
            n_rest = 0
            for (n, _, _), end_s in zip(problem.rest, rest_ends, strict=True):
                if end_s <= t_s:
                    continue
                if n <= extra:
                    extra -= n
                else:
                    n_rest += 1
        if (len(held) + n_rest) * delay_s >= gain_s:
            continue
        for j in held:
            out[j], ends[j] = 0, None
        out[i] = 0
        # Candidates the drop-tail held back start in the cores left free now, if they end
        # before t, or are rigid and fit in what is still spare at t (an elastic one would be
        # stuck at its minimum: it waits for its own turn).
        free_now = spare + u
        for j in range(keep, len(members)):
            a = members[j][0]
            n = a.cost.units.min
            late = now_s + a.duration_s(n) > t_s
            if n <= free_now and (not late or (n <= extra and not a.cost.units.is_elastic)):
                out[j] = n
                free_now -= n
                extra -= n if late else 0
        return len(members), out  # one reservation per pool and round
    return keep, out


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
