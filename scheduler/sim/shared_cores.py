"""Time-shared cores of the simulated cluster: bounded sharers beside exclusive actions.

A sharer (`Allocation.shares`, `scheduler.policies.time_share`) runs on cores held by a running
exclusive action. Each tenant of such a core wants it whole (as the pod model assumes of every
thread, `scheduler.sim.cpu_share`: no credit for the idle time an action with E(m) < 1 leaves
on its cores), and CFS splits it by weight per core: the holder's sandbox weight over its cores
now (its own and any lent), each sharer's over its own cores (`core_share`). A run's speed is
its true speed-up at the cores' worth it gets (`SimAction.true_duration_s` at a fractional
count, as for pods): the holder's cores minus what its sharers take, a sharer's shares summed.
When the holder ends, its sharers split the core between them alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.execution import TimeShareSpec
from scheduler.policies.time_share import core_share

Core = tuple[str, int]  # (node, core id)


@dataclass
class SharedCores:
    """Who time-shares which core, and the cores' worth each tenant gets (see the module doc)."""

    spec: TimeShareSpec
    holder: dict[Core, str] = field(default_factory=dict)  # shared core -> its holder (if running)
    sharers: dict[Core, dict[str, float]] = field(default_factory=dict)  # -> sharer: weight per core
    weight: dict[str, float] = field(default_factory=dict)  # holder -> its weight per core now
    cores: dict[str, list[Core]] = field(default_factory=dict)  # tenant -> its shared cores

    def join(
        self, sharer: str, node: str, ids: tuple[int, ...], holder: str | None, holder_cores: int
    ) -> set[str]:
        """`sharer` starts on cores `ids` of `node`, held by `holder` (None: held by nobody now)
        on `holder_cores` cores; returns the other tenants whose speed changes."""
        mine = self.spec.weight / len(ids)
        touched: set[str] = set()
        for c in ids:
            core = (node, c)
            others = self.sharers.setdefault(core, {})
            touched.update(others)
            others[sharer] = mine
            self.cores.setdefault(sharer, []).append(core)
            if holder is not None and core not in self.holder:
                self.holder[core] = holder
                self.cores.setdefault(holder, []).append(core)
                self.weight[holder] = 1.0 / max(1, holder_cores)
            h = self.holder.get(core)
            if h is not None:
                touched.add(h)
        return touched

    def leave(self, tenant: str) -> set[str]:
        """`tenant` (a holder or a sharer) ended: the tenants left on its shared cores, whose
        speed changes."""
        touched: set[str] = set()
        for core in self.cores.pop(tenant, ()):
            others = self.sharers.get(core, {})
            if self.holder.get(core) == tenant:
                del self.holder[core]
            else:
                others.pop(tenant, None)
                h = self.holder.get(core)
                if h is not None:
                    touched.add(h)
            touched.update(others)
            if not others:
                self.sharers.pop(core, None)
                h = self.holder.pop(core, None)
                if h is not None:  # its last sharer left: the holder has the core to itself
                    self.cores[h].remove(core)
                    if not self.cores[h]:
                        del self.cores[h]
                        self.weight.pop(h, None)
        self.weight.pop(tenant, None)
        return touched

    def reweigh(self, holder: str, holder_cores: int) -> set[str]:
        """`holder` now runs on `holder_cores` cores (a loan changed): its sharers' speeds change."""
        if holder not in self.weight:
            return set()
        self.weight[holder] = 1.0 / max(1, holder_cores)
        return {s for core in self.cores[holder] for s in self.sharers.get(core, {})}

    def worth(self, tenant: str, own_cores: float) -> float:
        """The cores' worth `tenant` gets: a holder its `own_cores` minus what its sharers take,
        a sharer the sum of its shares (`own_cores` when it shares nothing)."""
        shared = self.cores.get(tenant)
        if not shared:
            return own_cores
        if tenant in self.weight:  # a holder
            mine = self.weight[tenant]
            lost = sum(1.0 - core_share(mine, 0.0, self.sharers[c].values()) for c in shared)
            return own_cores - lost
        out = 0.0
        for core in shared:
            others = self.sharers[core]
            h = self.holder.get(core)
            rest = [w for s, w in others.items() if s != tenant]
            out += core_share(others[tenant], self.weight[h] if h is not None else 0.0, rest)
        return out
