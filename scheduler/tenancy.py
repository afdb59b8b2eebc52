"""Tenant caps: what a round may start for each tenant the operator limited (issue 37).

A tenant is a job (`QueuedAction.job_id`: the service sets it to the tenant's name at intake).
The operator may cap what a tenant's running actions hold at once (`TenantCaps`): CPU cores,
sandbox memory, GPU memory, and a share of each API's concurrency and rate. The round
(`scheduler.round.Round`) applies them around the policy, in two steps:

1. **Before the policy** (`Tenancy.admit`): the waiting queue, in the order the round hands it
   to the policy, without the actions whose tenant could not take even their smallest unit
   count now (each counted at that, in queue order, on top of what the tenant's running actions
   hold). The policy places the others as if the held ones were not there: a tenant at its cap
   blocks no other tenant. An elastic CPU action of a capped tenant is offered only the unit
   counts that fit under its tenant's cores.
2. **After the policy** (`Ledger.keep`): its allocations (then the batch riders and time
   sharers the round adds) in order, without those that would take their tenant over a cap at
   the units they were given (two elastic actions of a tenant that together grew past it; a
   rider of a held action). The first allocation of a tenant always fits (step 1 offered it
   only what fits), so a capped tenant always makes progress.

A held action stays queued; it starts once its tenant's running actions give units back. A
tenant without caps (the `default` tenant, and any the operator did not limit) is never looked
at, and while no capped tenant has an action queued the round is exactly what it is without
tenants (benchmarks/decision_digest.py).

What counts: a running CPU action holds the cores of its allocation and, when it has a sandbox,
its `memory_mb`; a GPU call its `gpu_memory_mb`; an API call one of its API's concurrency and
its `api_quota` tokens. Batch riders and time sharers count like the others (they run on cores
held for them). Cores lent to a running malleable action (`Round.loans`) are not counted: a
loan is taken back as soon as an allocation needs the core.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from scheduler.model import Allocation, Elastic, QueuedAction, ResourceKind
from scheduler.pools import ApiPool
from scheduler.resources import ClusterState

DEFAULT_JOB = "default"  # `QueuedAction.job_id`'s default: the operator's own work, never capped


@dataclass(frozen=True, slots=True)
class TenantCaps:
    """What one tenant's running actions may hold at once; 0 (or no share): no limit of that kind.

    `api_share`: API name -> the fraction of that API's concurrency and rate the tenant may use
    (`api_limit`)."""

    cores: int = 0
    memory_mb: int = 0
    gpu_memory_mb: int = 0
    api_share: Mapping[str, float] = field(default_factory=dict)

    @property
    def limits(self) -> bool:
        """Does it limit anything?"""
        return bool(self.cores or self.memory_mb or self.gpu_memory_mb or self.api_share)


def api_limit(total: int | None, share: float) -> int | None:
    """A tenant's part of an API's `total` (concurrency, or tokens per window): `share` of it
    rounded down, at least 1 (None: the API has no such limit)."""
    if total is None:
        return None
    return max(1, math.floor(total * min(max(share, 0.0), 1.0)))


def refusal(qa: QueuedAction, caps: TenantCaps | None, api: Mapping[str, ApiPool]) -> str | None:
    """Why `qa` could never start under its tenant's `caps`, even with nothing else of its
    tenant running (None: it can). Such an action would wait for ever: refuse it at intake.
    `api`: the API pools (`ClusterState.api`)."""
    if caps is None:
        return None
    cost = qa.cost
    if cost.key is ResourceKind.CPU:
        if caps.cores and cost.units.min > caps.cores:
            return f"it needs {cost.units.min} cores; its tenant may hold {caps.cores}"
        if caps.memory_mb and cost.sandbox and cost.memory_mb > caps.memory_mb:
            return f"it needs {cost.memory_mb} MB of memory; its tenant may hold {caps.memory_mb} MB"
    elif cost.key is ResourceKind.GPU:
        if caps.gpu_memory_mb and cost.gpu_memory_mb > caps.gpu_memory_mb:
            return (
                f"it needs {cost.gpu_memory_mb} MB of GPU memory; its tenant may hold {caps.gpu_memory_mb} MB"
            )
    else:
        share, pool = caps.api_share.get(qa.target), api.get(qa.target)
        tokens = api_limit(pool.quota_per_window, share) if share is not None and pool is not None else None
        if tokens is not None and cost.api_quota > tokens:
            return f"a call takes {cost.api_quota} tokens of API {qa.target}; its tenant's share is {tokens}"
    return None


@dataclass(slots=True)
class Usage:
    """What one tenant's actions hold: cores, sandbox memory, GPU memory, API calls in flight
    per API, and API tokens taken this round per API."""

    cores: int = 0
    memory_mb: int = 0
    gpu_memory_mb: int = 0
    api: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)

    def copy(self) -> Usage:
        return Usage(self.cores, self.memory_mb, self.gpu_memory_mb, dict(self.api), dict(self.tokens))

    def add(self, qa: QueuedAction, units: int) -> None:
        """Count `qa` running at `units` units of its key resource."""
        key = qa.cost.key
        if key is ResourceKind.CPU:
            self.cores += units
            if qa.cost.sandbox:
                self.memory_mb += qa.cost.memory_mb
        elif key is ResourceKind.GPU:
            self.gpu_memory_mb += qa.cost.gpu_memory_mb
        else:
            self.api[qa.target] = self.api.get(qa.target, 0) + 1


class Ledger:
    """One round's view of the capped tenants: what each holds, as the round's starts add up.
    Made by `Tenancy.admit`; `keep` filters the round's starts."""

    def __init__(self, tenancy: Tenancy, usage: dict[str, Usage], state: ClusterState, now_s: float) -> None:
        self.tenancy, self.usage, self.state, self.now_s = tenancy, usage, state, now_s

    def fits(self, qa: QueuedAction, units: int) -> bool:
        """Can `qa` start at `units` units without taking its tenant over a cap?"""
        caps = self.tenancy.caps.get(qa.job_id)
        if caps is None:
            return True
        u = self.usage.get(qa.job_id)
        if u is None:
            u = self.usage[qa.job_id] = Usage()
        key, cost = qa.cost.key, qa.cost
        if key is ResourceKind.CPU:
            if caps.cores and u.cores + units > caps.cores:
                return False
            return not (caps.memory_mb and cost.sandbox and u.memory_mb + cost.memory_mb > caps.memory_mb)
        if key is ResourceKind.GPU:
            return not (caps.gpu_memory_mb and u.gpu_memory_mb + cost.gpu_memory_mb > caps.gpu_memory_mb)
        share = caps.api_share.get(qa.target)
        pool = self.state.api.get(qa.target)
        if share is None or pool is None:
            return True
        limit = api_limit(pool.max_concurrency, share)
        if limit is not None and u.api.get(qa.target, 0) >= limit:
            return False
        bucket = self.tenancy.bucket(qa.job_id, pool, share, self.now_s)
        taken = u.tokens.get(qa.target, 0)
        return bucket is None or bucket.tokens - taken >= cost.api_quota

    def take(self, qa: QueuedAction, units: int, spend: bool = False) -> None:
        """`qa` starts at `units` units: its tenant holds them (a tenant without caps: nothing).
        Its API tokens are noted as taken this round, or with `spend` taken from its tenant's
        bucket."""
        caps = self.tenancy.caps.get(qa.job_id)
        if caps is None:
            return
        self.usage[qa.job_id].add(qa, units)
        quota = qa.cost.api_quota
        share = caps.api_share.get(qa.target) if qa.cost.key is ResourceKind.API and quota else None
        pool = self.state.api.get(qa.target) if share is not None else None
        if pool is None or share is None:
            return
        if spend:
            bucket = self.tenancy.bucket(qa.job_id, pool, share, self.now_s)
            if bucket is not None:
                bucket.tokens -= quota
        else:
            tokens = self.usage[qa.job_id].tokens
            tokens[qa.target] = tokens.get(qa.target, 0) + quota

    def keep(
        self, allocs: Iterable[Allocation], action_of: Callable[[str], QueuedAction]
    ) -> list[Allocation]:
        """`allocs` in order, without those that take their tenant over a cap (counted as held);
        the API tokens of those kept are taken from their tenants' buckets."""
        out: list[Allocation] = []
        caps, held = self.tenancy.caps, self.tenancy.held
        for a in allocs:
            qa = action_of(a.action_id)
            if qa.job_id in caps:
                if not self.fits(qa, a.units):
                    held[qa.job_id] = held.get(qa.job_id, 0) + 1
                    continue
                self.take(qa, a.units, spend=True)
            out.append(a)
        return out


class Tenancy:
    """The caps per tenant and what the capped tenants' running actions hold (`Round.tenancy`).

    `caps`: job id -> its caps (`set_caps`; the executor keeps it up to date); `held`: job id ->
    its actions the last round held back (for metrics)."""

    def __init__(self, caps: Mapping[str, TenantCaps] | None = None) -> None:
        self.caps: dict[str, TenantCaps] = {}
        self.held: dict[str, int] = {}
        # running actions of every job but the default one, per job (caps may come later)
        self._running: dict[str, dict[str, QueuedAction]] = {}
        self._tracked = 0
        self._buckets: dict[tuple[str, str], tuple[float, ApiPool]] = {}  # (job, API) -> (share, bucket)
        self.set_caps(caps or {})

    def set_caps(self, caps: Mapping[str, TenantCaps]) -> None:
        """Replace the caps (jobs whose caps limit nothing, and the default job, are left out)."""
        self.caps = {job: c for job, c in caps.items() if c.limits and job != DEFAULT_JOB}
        self._buckets = {k: v for k, v in self._buckets.items() if k[0] in self.caps}

    def active(self, jobs: Iterable[str]) -> bool:
        """Does a capped tenant have an action queued (`jobs`: the jobs queued)?"""
        caps = self.caps
        return bool(caps) and any(job in caps for job in jobs)

    def track(self, qa: QueuedAction) -> None:
        """`qa` started (or runs since before a restart): it counts towards its tenant."""
        if qa.job_id == DEFAULT_JOB:
            return
        self._running.setdefault(qa.job_id, {})[qa.action_id] = qa
        self._tracked += 1

    def prune(self, state: ClusterState) -> None:
        """Forget the tracked actions that ended, once they are many."""
        if self._tracked <= 4 * len(state.running) + 1024:
            return
        running = state.running
        self._running = {
            job: left
            for job, acts in self._running.items()
            if (left := {aid: qa for aid, qa in acts.items() if aid in running})
        }
        self._tracked = sum(len(acts) for acts in self._running.values())

    def usage(self, state: ClusterState) -> dict[str, Usage]:
        """What each capped tenant's running actions hold now (ended ones are forgotten)."""
        out: dict[str, Usage] = {}
        running = state.running
        for job in self.caps:
            acts = self._running.get(job)
            u = out[job] = Usage()
            if not acts:
                continue
            for aid in [aid for aid in acts if aid not in running]:
                del acts[aid]
                self._tracked -= 1
            for aid, qa in acts.items():
                u.add(qa, running[aid].units)
        return out

    def bucket(self, job: str, pool: ApiPool, share: float, now_s: float) -> ApiPool | None:
        """`job`'s token bucket for API `pool`, refilled to `now_s`: `share` of the pool's tokens
        per window (`api_limit`), full when made or when the share changed (None: the API has
        no rate limit)."""
        if pool.quota_per_window is None:
            return None
        key = (job, pool.name)
        have = self._buckets.get(key)
        if have is not None and have[0] == share:
            have[1].refill(now_s)
            return have[1]
        quota = api_limit(pool.quota_per_window, share)
        b = ApiPool(pool.name, quota_per_window=quota, window_s=pool.window_s, tokens_at_s=now_s)
        self._buckets[key] = (share, b)
        return b

    def admit(
        self, ordered: Sequence[QueuedAction], state: ClusterState, now_s: float
    ) -> tuple[list[QueuedAction], Ledger]:
        """The queue as the policy is to see it (see the module doc, step 1), and the round's
        ledger for step 2; `held` is what step 1 held back."""
        base = self.usage(state)
        look = Ledger(self, {j: u.copy() for j, u in base.items()}, state, now_s)
        held: dict[str, int] = {}
        self.held = held
        caps = self.caps
        out: list[QueuedAction] = []
        cpu = ResourceKind.CPU
        for qa in ordered:
            job = qa.job_id
            if job not in caps:
                out.append(qa)
                continue
            units = qa.cost.units
            if not look.fits(qa, units.min):
                held[job] = held.get(job, 0) + 1
                continue
            room = caps[job].cores - look.usage[job].cores
            look.take(qa, units.min)
            if qa.cost.key is cpu and caps[job].cores and units.max > room:
                fit = Elastic(tuple(n for n in units.units if n <= room))
                qa = dataclasses.replace(qa, cost=dataclasses.replace(qa.cost, units=fit))
            out.append(qa)
        return out, Ledger(self, base, state, now_s)
