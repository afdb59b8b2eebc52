"""What a GPU call pays before it runs, per service and per tier (issue 38): learned, pure.

A reward call placed on a chunk finds its service there in one of three tiers
(`scheduler.gpu_cache.Tier`): resident on the device (nothing to pay), kept in host memory by a
live process (its weights are copied back), or nowhere (a cold load: a process starts, imports
its libraries and reads its weights). The live GPU worker reports, with every call, the tier
its lease found and the seconds the restore or load took (`ActionResult.load_tier`,
`load_s`); the live scheduler feeds them to `RestoreCosts.observe` from the completions, and
the policies read `RestoreCosts.cost_s` where a choice trades a restore against another
(`scheduler.policies.gpu_aware`). No I/O and no clock: the simulator may feed the same object
with what it charges.

Until a (service, tier) has been observed, the estimate is the tier's own average over every
service observed (one machine's restores are alike in scale), and before any observation of
the tier at all, a seed:

- `DEVICE`: 0 s. A resident instance is used as it is.
- `HOST`: 0.05 s, the issue's target for a host-tier restore of the small models on a CPU-kind
  node (p50 <= 50 ms). On a GPU host it is a fixed overhead plus size / host-to-device
  bandwidth; modelling that from a stated size is the simulator's (`scheduler.sim`), the live
  scheduler learns it.
- `COLD`: 5 s, a cold load as measured on this machine (issue 38: about 4.8 s per cold load of
  a tiny model with `tangram up` on `configs/local.yaml`).

Each estimate is an exponentially weighted moving average (`alpha` per sample); the first
sample of a (service, tier) replaces its seed, so one cold load is enough to know its order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from scheduler.gpu_cache import Tier

SEED_RESTORE_S: Mapping[Tier, float] = {Tier.DEVICE: 0.0, Tier.HOST: 0.05, Tier.COLD: 5.0}
TIER_ORDER = (Tier.DEVICE, Tier.HOST, Tier.COLD)  # cheapest first


def parse_tier(value: str) -> Tier | None:
    """The tier a wire field names ("" or an unknown word: None, nothing to learn)."""
    try:
        return Tier(value)
    except ValueError:
        return None


@dataclass
class RestoreCosts:
    """Restore seconds per (service, tier), learned as an EWMA of reported samples (see the
    module doc); `seed_s` are the estimates before any sample of a tier."""

    alpha: float = 0.3
    seed_s: Mapping[Tier, float] = field(default_factory=lambda: dict(SEED_RESTORE_S))
    _by_service: dict[tuple[str, Tier], float] = field(default_factory=dict)
    _by_tier: dict[Tier, float] = field(default_factory=dict)
    counts: dict[Tier, int] = field(default_factory=dict)  # samples seen per tier

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha {self.alpha}: need 0 < alpha <= 1")

    def observe(self, service: str, tier: Tier, load_s: float) -> None:
        """One call of `service` found it in `tier` and spent `load_s` seconds restoring it."""
        sample = max(0.0, float(load_s))
        key = (service, tier)
        self._by_service[key] = self._blend(self._by_service.get(key), sample)
        self._by_tier[tier] = self._blend(self._by_tier.get(tier), sample)
        self.counts[tier] = self.counts.get(tier, 0) + 1

    def _blend(self, old: float | None, sample: float) -> float:
        return sample if old is None else old + self.alpha * (sample - old)

    def cost_s(self, service: str, tier: Tier) -> float:
        """Expected seconds a call of `service` pays before it runs when its instance is in `tier`."""
        got = self._by_service.get((service, tier))
        if got is not None:
            return got
        got = self._by_tier.get(tier)
        return got if got is not None else self.seed_s.get(tier, SEED_RESTORE_S[tier])

    def learned(self) -> dict[tuple[str, Tier], float]:
        """The per-(service, tier) estimates observed so far (for reports and tests)."""
        return dict(self._by_service)


def tier_on(
    service: str,
    chunk: tuple[int, ...],
    resident: Mapping[tuple[int, ...], list[str]],
    host_resident: Mapping[tuple[int, ...], list[str]],
) -> Tier:
    """The tier `service` is in on `chunk` of a node holding `resident` on its devices and
    `host_resident` in host memory only."""
    if service in resident.get(chunk, ()):
        return Tier.DEVICE
    if service in host_resident.get(chunk, ()):
        return Tier.HOST
    return Tier.COLD


SEEDED = RestoreCosts()  # read-only by convention: the seeds, for a node with nothing learned
