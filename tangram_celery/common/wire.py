"""Everything that crosses a process boundary, as one versioned pydantic model each.

Client -> scheduler: `ActionMeta` (the intake entry and the action's hash; never payloads).
Scheduler -> clients: `PoolView` (what can run here, published in Redis).
Scheduler -> itself after a restart: `DispatchRecord` (`tangram:running`).
Scheduler -> worker: `TaskOrder` (the Celery message's second argument), `CoreLoan` (cores lent
to a running malleable action) and `GpuWarm` (a warm restore or retirement on a GPU node).
Worker -> scheduler: `Completion` and `ResidencyReport` (the events stream).
Worker (or scheduler) -> client: `ActionResult` (the action's hash; what the client returns).

Each side validates what it reads with these models only. Every model has a version `v`;
records older than versions read as version 1 (`ActionMeta`: as its current one); a model whose
fields changed reads its older versions too. `PoolView.refusal` is the one check of whether an
action can run here, made by the clients at submit and by the scheduler at intake.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator

from tangram_celery.common.actions import (
    IMAGE_PATTERN,
    JOB_PATTERN,
    NAME_PATTERN,
    ActionStatus,
    ApiAction,
    CodeAction,
    PhaseOutcome,
    Priority,
    RewardAction,
    TestOutcome,
)
from tangram_celery.common.config import LimitsConfig, TangramConfig
from tangram_celery.common.tenants import QUALIFIED_PATTERN, QUALIFIED_TRAJECTORY_PATTERN, SEP

WIRE_VERSION = 1  # of every model that has not changed since versions began
Chunk = tuple[int, ...]
_NAME = NAME_PATTERN
NO_TRAJECTORY = ""  # the trajectory of a one-shot action without one, in every model here


def wire_trajectory(trajectory_id: str | None) -> str:
    """An action's trajectory id between processes (`NO_TRAJECTORY` for an action's None)."""
    return trajectory_id or NO_TRAJECTORY


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = 1  # WIRE_VERSION


# ---- client -> scheduler -----------------------------------------------------------------------
class ActionMeta(_Wire):
    """What the scheduler decides on: who, what kind, how big. Code, prompts and request bodies
    stay in the action's hash in Redis.

    `trajectory_id` is `NO_TRAJECTORY` for an action of no trajectory; `one_shot` marks an
    action that runs in a sandbox of its own (`_Action.one_shot`). Code actions carry `cpus`
    (min, max) and `memory_mb`, reward actions `model`, API actions `api`.

    Version 2 renamed `ephemeral` to `one_shot`; version 1 records read as before.

    Its ids are qualified (`tenants.qualify`) by the scheduler; an intake entry's are `is_local`."""

    v: Literal[1, 2] = 2  # type: ignore[assignment]
    id: str = Field(pattern=QUALIFIED_PATTERN)
    type: Literal["code", "reward", "api"]
    trajectory_id: str = Field(NO_TRAJECTORY, pattern=QUALIFIED_TRAJECTORY_PATTERN)
    job_id: str = Field("default", pattern=JOB_PATTERN)
    priority: Priority = 0
    timeout_s: float = Field(10.0, gt=0)
    submitted_s: float
    one_shot: bool = Field(False, validation_alias=AliasChoices("one_shot", "ephemeral"))
    cpus: tuple[int, int] | None = None
    memory_mb: int | None = Field(None, ge=1)
    has_tests: bool = False
    language: str | None = Field(None, max_length=32)  # code actions (absent in older records)
    image: str | None = Field(None, pattern=IMAGE_PATTERN, max_length=400)  # code: its trajectory's
    model: str | None = Field(None, pattern=_NAME)
    api: str | None = Field(None, pattern=_NAME)

    @model_validator(mode="after")
    def _fields_of_type(self) -> ActionMeta:
        need = {"code": ("cpus", "memory_mb"), "reward": ("model",), "api": ("api",)}[self.type]
        for name in need:
            if getattr(self, name) is None:
                raise ValueError(f"a {self.type} action's metadata needs {name}")
        optional = {"language", "image"} if self.type == "code" else set()
        for name in {"cpus", "memory_mb", "model", "api", "language", "image"} - set(need) - optional:
            if getattr(self, name) is not None:
                raise ValueError(f"a {self.type} action's metadata has no {name}")
        if self.cpus is not None and not 1 <= self.cpus[0] <= self.cpus[1]:
            raise ValueError(f"cpus {list(self.cpus)}: need 1 <= min <= max")
        return self

    @classmethod
    def of(cls, action: CodeAction | RewardAction | ApiAction, submitted_s: float) -> ActionMeta:
        """The metadata of a (validated) action submitted at `submitted_s` (epoch seconds)."""
        common: dict[str, Any] = {
            "id": action.id,
            "type": action.type,
            "trajectory_id": wire_trajectory(action.trajectory_id),
            "job_id": action.job_id,
            "priority": action.priority,
            "timeout_s": action.timeout_s,
            "submitted_s": submitted_s,
            "one_shot": action.one_shot,
        }
        if isinstance(action, CodeAction):
            has_tests = bool(action.test_cases or action.test_command)
            return cls(
                **common,
                cpus=action.cpu_range,
                memory_mb=action.memory_mb,
                has_tests=has_tests,
                language=action.language,
                image=action.image,
            )
        if isinstance(action, RewardAction):
            return cls(**common, model=action.model)
        return cls(**common, api=action.api)

    def dumps(self) -> str:
        return self.model_dump_json(exclude_none=True)

    @property
    def is_local(self) -> bool:
        return SEP not in self.id and SEP not in self.trajectory_id  # not qualified


# ---- scheduler -> clients ----------------------------------------------------------------------
class ModelView(_Wire):
    backend: str
    max_batch: int = Field(ge=1)


class PoolView(_Wire):
    """What a client needs to refuse impossible actions at submit (`tangram:config`)."""

    max_cpus: int = Field(ge=0, description="cores of the largest NUMA group of any CPU node")
    max_memory_mb: int = Field(ge=0, description="memory of the largest CPU node, MiB")
    models: dict[str, ModelView] = Field(default_factory=dict)
    apis: list[str] = Field(default_factory=list)
    max_queued: int = Field(0, ge=0, description="intake bound (0: none)")
    limits: LimitsConfig = LimitsConfig()
    admit_memory_fraction: float = Field(0.8, gt=0, le=1)
    # what the CPU workers reported their sandboxes run (`tangram:languages`), overlaid by the
    # clients at submit; None: no worker has reported yet, so languages are not checked here
    languages: list[str] | None = None

    def with_languages(self, by_node: dict[str, list[str]]) -> PoolView:
        """This view with the languages any CPU node reported (unchanged when none has)."""
        if not by_node:
            return self
        offered = sorted({lang for langs in by_node.values() for lang in langs})
        return self.model_copy(update={"languages": offered})

    @classmethod
    def of(cls, cfg: TangramConfig) -> PoolView:
        return cls(
            max_cpus=max((max(len(g) for g in n.numa_split()) for n in cfg.nodes.cpu), default=0),
            max_memory_mb=max((n.memory_mb for n in cfg.nodes.cpu), default=0),
            models={m.name: ModelView(backend=m.backend, max_batch=m.max_batch) for m in cfg.reward_models},
            apis=[a.name for a in cfg.apis],
            max_queued=cfg.scheduler.max_queued,
            limits=cfg.limits,
            admit_memory_fraction=cfg.broker.admit_memory_fraction,
        )

    def refusal(self, meta: ActionMeta) -> str | None:
        """Why the action can never run on this deployment, or None if it can."""
        if meta.type == "code":
            assert meta.cpus is not None and meta.memory_mb is not None
            if self.max_cpus == 0:
                return "no CPU node is configured (nodes.cpu is empty)"
            if meta.cpus[0] > self.max_cpus:
                return f"cpus min {meta.cpus[0]} exceeds the largest NUMA group ({self.max_cpus} cores)"
            if meta.memory_mb > self.max_memory_mb:
                return f"memory_mb {meta.memory_mb} exceeds every CPU node's memory"
            if (
                self.languages is not None
                and meta.language is not None
                and meta.language not in self.languages
            ):
                return (
                    f"language {meta.language!r} is not available: no CPU node's sandbox has its "
                    f"toolchain (available: {', '.join(self.languages) or 'none'})"
                )
            return None
        if meta.type == "reward":
            if meta.model not in self.models:
                known = ", ".join(sorted(self.models)) or "none"
                return f"unknown reward model {meta.model!r} (configured: {known})"
            return None
        if meta.api not in self.apis:
            return f"unknown API {meta.api!r} (configured: {', '.join(self.apis) or 'none'})"
        return None


# ---- scheduler -> worker, and the scheduler's own dispatch records --------------------------------
class SandboxOrder(_Wire):
    """The scheduler's word on a code action's trajectory sandbox (scheduler/service/sandboxes.py):
    its generation, whether this action starts it, whether the caller lost the last one (`why`)."""

    gen: str = ""
    new: bool = False
    reset: bool = False
    why: str | None = None  # sent only when known (a drained node): workers before it refuse it


class AllocationWire(_Wire):
    """A `scheduler.model.Allocation` on the wire (`shares`: it time-shares `unit_ids`, cores
    held by a running action)."""

    action_id: str
    kind: Literal["cpu", "gpu", "api"]
    pool: str
    units: int = Field(ge=1)
    unit_ids: tuple[int, ...] = ()
    evict: tuple[str, ...] = ()
    shares: bool = False


class TaskOrder(AllocationWire):
    """What a worker is told with the Celery message: the allocation, the attempt it runs as
    (older attempts cannot claim), how many actions were sent together on its pool (on a GPU
    chunk: one batch), for code actions the sandbox to use, and the sandboxes of evicted
    trajectories the CPU worker removes first ((trajectory, generation) each, as a close
    message would: carried by the round's first message to the node, to save one message per
    eviction). A time sharer (`shares`) runs on its cores beside the action that holds them,
    its sandbox at `cpu_weight` times the default CPU weight while it runs."""

    attempt: int = Field(1, ge=1)
    batch: int = Field(1, ge=1)
    sandbox: SandboxOrder | None = None
    closes: tuple[tuple[str, str], ...] = ()
    cpu_weight: float | None = Field(None, gt=0, le=1)


class CoreLoan(_Wire):
    """Scheduler -> the CPU worker of `pool`: every core lent now to running malleable action
    `action_id` besides its own (empty: all taken back). `seq` grows with every loan the
    scheduler sends, across its restarts: a worker applies a borrower's loans newest first and
    drops older ones that arrive late (`tangram_celery.workers.loans`)."""

    action_id: str = Field(pattern=QUALIFIED_PATTERN)
    pool: str
    cores: tuple[int, ...] = ()
    seq: int = Field(ge=1)


class GpuWarm(_Wire):
    """Scheduler -> the GPU worker of `pool`: make reward model `service` resident on `chunk`
    ahead of its calls (`load`: a warm restore, in free memory only), or unload it there while
    the chunk is idle (`unload`: an instance the load outgrew). The worker answers with a
    `ResidencyReport` naming this order."""

    op: Literal["load", "unload"] = "load"
    pool: str
    chunk: tuple[int, ...] = Field(min_length=1)
    service: str = Field(pattern=_NAME)
    seq: int = Field(ge=1)


class DispatchRecord(_Wire):
    """A dispatched, unfinished action as the scheduler persists it (`tangram:running`): enough
    to rebuild its allocation and its queue entry after a restart."""

    alloc: AllocationWire
    meta: ActionMeta
    attempt: int = Field(1, ge=1)
    sandbox: SandboxOrder | None = None


# ---- worker (or scheduler) -> client -------------------------------------------------------------
class ActionResult(_Wire):
    """What comes back for every action, whatever happened to it.

    `sandbox_reset` is True when a code action of a trajectory ran in a fresh sandbox although
    the trajectory had one before: it was evicted to make room (memory is a cache), removed
    after the idle TTL, lost with its worker or node, or it died. Files written by earlier
    actions of the trajectory are gone.

    `attempts` is the attempt the action ran as (`TaskOrder.attempt`): how many times it was
    dispatched; 0 when it never was (refused, cancelled).
    """

    model_config = ConfigDict(extra="ignore", frozen=True)  # a client reads a newer result too

    action_id: str
    trajectory_id: str = NO_TRAJECTORY
    status: ActionStatus
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    tests: list[TestOutcome] = Field(default_factory=list)
    compile: PhaseOutcome | None = None  # the compile phase, if any; stdout etc. are the run's
    output: Any = None  # reward scores / API response
    error: str = ""  # infrastructure or rejection reason
    # why the sandbox chose the status or what it did about a limit, when that is not obvious:
    # the files a disk-quota roll-back removed, deselected tests, a runner that was lost
    detail: str = ""
    queue_s: float = 0.0
    exec_s: float = 0.0
    act_s: float = 0.0
    units: int = 0  # DoP granted
    node: str = ""
    attempts: int = 1
    sandbox_reset: bool = False
    files: dict[str, str] = Field(default_factory=dict)  # fetch_files: path -> base64 content
    # Actions started together with this one, itself included: for a reward action on a GPU, the
    # requests scored in the one model call it rode in; otherwise the actions the scheduler placed
    # on the same pool in the same round. 0 when it never ran.
    batch_size: int = 0
    # CPU seconds a code action's sandbox used while it ran (cgroup accounting; None where the
    # kernel does not account it)
    cpu_s: float | None = None
    # a GPU call's: where its model was (a `scheduler.gpu_cache.Tier` value: device, host, cold;
    # "" for any other action) and the seconds spent restoring it (0 on a hit), as each rider sees
    load_tier: str = ""
    load_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status is ActionStatus.OK


# ---- worker -> scheduler ---------------------------------------------------------------------------
class EventStatus(StrEnum):
    """How an action's turn at a worker (or the scheduler's refusal) ended, as the scheduler is
    told: every final `ActionStatus`, and two that exist only between the processes."""

    OK = "ok"
    FAILED = "failed"
    TIMEOUT = "timeout"
    MEMORY_LIMIT = "memory_limit"
    PIDS_LIMIT = "pids_limit"
    OUTPUT_LIMIT = "output_limit"
    DISK_LIMIT = "disk_limit"
    REJECTED = "rejected"
    ERROR = "error"
    CANCELLED = "cancelled"  # withdrawn before dispatch: drop it from the waiting queue
    RETRY = "retry"  # handed back by its worker after a retryable failure: place it again
    UNRUN = "unrun"  # finished by the scheduler without a worker (refused, given up)

    @property
    def ran(self) -> bool:
        """A worker ran the action to a result (its time is a duration sample)."""
        return self in (EventStatus.OK, EventStatus.FAILED)

    @classmethod
    def of(cls, status: ActionStatus) -> EventStatus:
        """The status a result's turn ends with (the same word)."""
        return cls(status.value)


class ChunkServices(_Wire):
    """Services resident on one GPU chunk, least recently used first."""

    gpus: tuple[int, ...] = Field(min_length=1)
    services: list[str]


def residency(resident: Mapping[Chunk, list[str]]) -> list[ChunkServices]:
    return [ChunkServices(gpus=c, services=list(s)) for c, s in resident.items()]


def resident_map(entries: list[ChunkServices]) -> dict[Chunk, list[str]]:
    return {e.gpus: list(e.services) for e in entries}


class Completion(_Wire):
    """An action's turn is over (`status`), and its units can be released. From a worker, with
    its timings and its completion counter `seq`; GPU workers add what their node holds."""

    type: Literal["completion"] = "completion"
    status: EventStatus
    trajectory_id: str = ""
    worker: str = ""
    seq: int = 0
    exec_s: float = 0.0
    cpu_s: float | None = None  # CPU seconds its sandbox used (what a time sharer is learned by)
    queue_s: float = 0.0
    act_s: float | None = None  # None: it never ran (not logged as a completed action)
    units: int = 0
    attempt: int = 1
    error: str = ""
    resident: list[ChunkServices] | None = None
    host_resident: list[ChunkServices] | None = None  # kept in host memory only (None: no host tier)
    # a rider handed back before it started (RETRY): not a failed attempt; it goes alone next
    unstarted: bool = False
    load_tier: str = ""  # `ActionResult.load_tier`, `load_s`: what the scheduler learns restores by
    load_s: float = 0.0

    @classmethod
    def of(
        cls,
        result: ActionResult,
        worker: str,
        seq: int,
        resident: list[ChunkServices] | None = None,
        host_resident: list[ChunkServices] | None = None,
    ) -> Completion:
        """The event of a worker's finished `result` (the `seq`-th completion of `worker`)."""
        return cls(
            status=EventStatus.of(result.status),
            worker=worker,
            seq=seq,
            exec_s=result.exec_s,
            cpu_s=result.cpu_s,
            queue_s=result.queue_s,
            act_s=result.act_s,
            units=result.units,
            attempt=result.attempts,
            trajectory_id=result.trajectory_id,
            resident=resident,
            host_resident=host_resident,
            load_tier=result.load_tier,
            load_s=result.load_s,
        )


class ResidencyReport(_Wire):
    """What a GPU node holds, outside any completion (after a warm-up load): on its devices, and
    in host memory only (`host_resident`; None from a node without a host tier). After a
    `GpuWarm` order, `warm` names it (settled: done, or `error` says why not)."""

    type: Literal["residency"] = "residency"
    pool: str
    resident: list[ChunkServices]
    host_resident: list[ChunkServices] | None = None
    warm: GpuWarm | None = None
    error: str = ""


def parse_event(raw: str) -> Completion | ResidencyReport:
    """An event of the events stream (ValueError if malformed). Completions written before
    events had a type read as completions."""
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError(f"an event is a JSON object, got {type(data).__name__}")
    if data.get("type") == "residency":
        return ResidencyReport.model_validate(data)
    return Completion.model_validate(data)
