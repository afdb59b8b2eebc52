"""The scheduler's settings (`scheduler:` in the deployment config, `tangram_celery.common.config`):
its policy, intake bounds, duration priors, fair share, CPU riders and run log."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field, field_validator, model_validator

from tangram_celery.common.config_front import StrictModel

if TYPE_CHECKING:
    from scheduler.execution import TimeShareSpec
    from scheduler.policies.base import Policy
    from scheduler.policies.cpu_batch import CpuBatchSpec


class PriorConfig(StrictModel):
    t1_s: float = Field(gt=0, description="expected duration at one unit, seconds")
    parallel_fraction: float = Field(0.0, ge=0, le=1, description="Amdahl p of the action kind")


class FairShareConfig(StrictModel):
    enabled: bool = Field(True, description="order jobs by priority, then weighted share (FCFS within a job)")
    weights: dict[str, float] = Field(default_factory=dict, description="share weight per job_id (default 1)")
    aging_s: float = Field(60.0, gt=0, description="a waiting job gains one priority level per aging_s")


class CpuBatchConfig(StrictModel):
    """Short CPU actions ride in batches on an allocation's cores under saturation
    (`scheduler.policies.cpu_batch`): one message, one round, back to back on the cores."""

    enabled: bool = Field(True, description="let short CPU actions ride behind an allocation")
    max_actions: int = Field(8, ge=2, le=256, description="actions per batch, the first one included")
    max_action_ms: float = Field(
        50.0, gt=0, le=60_000, description="only kinds measured to take at most this long ride"
    )
    max_batch_ms: float = Field(200.0, gt=0, le=600_000, description="measured work per batch, in all")
    join_below: int = Field(
        2,
        ge=0,
        le=256,
        description="a running batch with at most this many actions left takes the next riders "
        "behind them, so that they are on their way while those run (below 2: never)",
    )
    hand_back_after_ms: float = Field(
        2000.0,
        ge=0,
        le=3_600_000,
        description="an action of a batch still running after this long (hung until its limit) "
        "hands the riders behind it back to be placed again, alone (0: never)",
    )

    @model_validator(mode="after")
    def _bounds(self) -> CpuBatchConfig:
        if self.max_batch_ms < self.max_action_ms:
            raise ValueError(
                f"cpu_batch.max_batch_ms ({self.max_batch_ms}) is below max_action_ms "
                f"({self.max_action_ms}): no rider would ever fit; raise max_batch_ms"
            )
        return self

    def spec(self) -> CpuBatchSpec | None:
        """The round's bounds (None when off)."""
        from scheduler.policies.cpu_batch import CpuBatchSpec

        if not self.enabled:
            return None
        return CpuBatchSpec(
            self.max_actions, self.max_action_ms / 1000, self.max_batch_ms / 1000, self.join_below
        )


class TimeShareConfig(StrictModel):
    """Short rigid CPU actions time-share cores held by a running action under saturation
    (`scheduler.policies.time_share`), for the policies that share (`tangram-fast`)."""

    enabled: bool = Field(True, description="let short rigid CPU actions share held cores")
    max_action_ms: float = Field(
        5000.0, gt=0, le=600_000, description="only kinds measured to take at most this long share"
    )
    per_core: int = Field(1, ge=1, le=8, description="sharers on one held core at once")
    weight: float = Field(
        0.25, gt=0, le=1, description="a sharer's sandbox CPU weight relative to its host's (the default)"
    )
    min_share: float = Field(
        0.5, gt=0, le=1, description="a sharer gets at least this share of each core it shares"
    )
    max_holder_loss: float = Field(
        0.125, gt=0, lt=1, description="sharers take at most this fraction of a host's cores' worth"
    )

    def spec(self) -> TimeShareSpec | None:
        """The round's bounds (None when off)."""
        from scheduler.execution import TimeShareSpec

        if not self.enabled:
            return None
        return TimeShareSpec(
            self.max_action_ms / 1000, self.per_core, self.weight, self.min_share, self.max_holder_loss
        )


class SchedulerConfig(StrictModel):
    policy: str = Field(
        "tangram-fast", description="a live policy (the other baselines run in `tangram sim`)"
    )
    max_queued: int = Field(100_000, ge=1, description="intake bound; beyond it submit fails fast")
    batch_size: int = Field(512, ge=1, description="intake messages read per loop iteration")
    priors: dict[str, PriorConfig] = Field(
        default_factory=dict, description="duration priors per action kind"
    )
    fair_share: FairShareConfig = FairShareConfig()
    cpu_batch: CpuBatchConfig = CpuBatchConfig()
    time_share: TimeShareConfig = TimeShareConfig()
    run_log_max_mb: int = Field(
        256, ge=1, le=1 << 20, description="the run log (<state_dir>/actions.jsonl) is rotated at this size"
    )
    run_log_keep: int = Field(4, ge=0, le=1000, description="rotated run logs kept (actions.jsonl.1 ...)")
    check_invariants: bool = Field(
        False,
        description="debug: assert after every round that the round's core loans conserve work "
        "and time sharing keeps its bounds",
    )

    def make_policy(self) -> Policy:
        """The configured policy; one that time-shares cores (its execution model has
        `time_share`) gets the bounds of `time_share` (off: it never shares)."""
        from scheduler.policies import get_policy

        policy = get_policy(self.policy)
        if policy.execution.time_share is not None:
            policy = get_policy(self.policy, share=self.time_share.spec() or False)
        return policy

    @field_validator("policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        from scheduler.policies import get_policy, live_policies

        try:
            policy = get_policy(v)
        except KeyError as e:
            raise ValueError(str(e).strip("'\"")) from None
        gaps = policy.execution.live_gaps()
        if gaps:
            live = ", ".join("fixed-dop-K" if p == "fixed-dop" else p for p in live_policies())
            raise ValueError(
                f"policy {v!r} runs in the simulator only ({'; '.join(gaps)}); the live service runs {live}"
            )
        return v
