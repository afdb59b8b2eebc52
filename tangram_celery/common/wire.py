"""Everything that crosses a process boundary, as one versioned pydantic model each.

Client -> scheduler: `ActionMeta` (the intake entry and the action's hash; never payloads).
Scheduler -> clients: `PoolView` (what can run here, published in Redis).
Scheduler -> itself after a restart: `DispatchRecord` (`tangram:running`).
Scheduler -> worker: `TaskOrder` (the Celery message's second argument), `CoreLoan` (cores lent
to a running malleable action) and `GpuWarm` (a warm restore or retirement on a GPU node).
Worker -> scheduler: `Completion` and `ResidencyReport` (the events stream).

Each side validates what it reads with these models and nothing else, so a field is added or
renamed in one place. Every model has a version `v`; records written before versions existed
read as version 1. `PoolView.refusal` is the one check of whether an action can run on the
deployment, made by the clients (sync and async) at submit and by the scheduler at intake.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tangram_celery.common.actions import ApiAction, CodeAction, RewardAction
from tangram_celery.common.config import LimitsConfig, TangramConfig

WIRE_VERSION = 1
Chunk = tuple[int, ...]
_ID = r"^[A-Za-z0-9_.:-]{1,128}$"
_NAME = r"^[a-z0-9][a-z0-9_.-]{0,62}$"


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = 1  # WIRE_VERSION


# ---- client -> scheduler -----------------------------------------------------------------------
class ActionMeta(_Wire):
    """What the scheduler decides on: who, what kind, how big. Code, prompts and request bodies
    stay in the action's hash in Redis.

    `trajectory_id` is "" for an action of no trajectory; `ephemeral` marks a one-shot action
    (it runs in a sandbox of its own). Code actions carry `cpus` (min, max) and `memory_mb`,
    reward actions `model`, API actions `api`.
    """

    id: str = Field(pattern=_ID)
    type: Literal["code", "reward", "api"]
    trajectory_id: str = Field("", pattern=r"^([A-Za-z0-9_.:-]{1,128})?$")
    job_id: str = Field("default", pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    priority: int = Field(0, ge=-100, le=100)
    timeout_s: float = Field(10.0, gt=0)
    submitted_s: float
    ephemeral: bool = False
    cpus: tuple[int, int] | None = None
    memory_mb: int | None = Field(None, ge=1)
    has_tests: bool = False
    language: str | None = Field(None, max_length=32)  # code actions (absent in older records)
    model: str | None = Field(None, pattern=_NAME)
    api: str | None = Field(None, pattern=_NAME)

    @model_validator(mode="after")
    def _fields_of_type(self) -> ActionMeta:
        need = {"code": ("cpus", "memory_mb"), "reward": ("model",), "api": ("api",)}[self.type]
        for name in need:
            if getattr(self, name) is None:
                raise ValueError(f"a {self.type} action's metadata needs {name}")
        optional = {"language"} if self.type == "code" else set()
        for name in {"cpus", "memory_mb", "model", "api", "language"} - set(need) - optional:
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
            "trajectory_id": action.trajectory_id or "",
            "job_id": action.job_id,
            "priority": action.priority,
            "timeout_s": action.timeout_s,
            "submitted_s": submitted_s,
            "ephemeral": action.one_shot,
        }
        if isinstance(action, CodeAction):
            has_tests = bool(action.test_cases or action.test_command)
            return cls(
                **common,
                cpus=action.cpu_range,
                memory_mb=action.memory_mb,
                has_tests=has_tests,
                language=action.language,
            )
        if isinstance(action, RewardAction):
            return cls(**common, model=action.model)
        return cls(**common, api=action.api)

    def dumps(self) -> str:
        return self.model_dump_json(exclude_none=True)


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
    its generation, whether this action starts it, whether the caller lost the previous one."""

    gen: str = ""
    new: bool = False
    reset: bool = False


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

    action_id: str = Field(pattern=_ID)
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
    # a rider handed back before it started (RETRY): not a failed attempt; it goes alone next
    unstarted: bool = False


class ResidencyReport(_Wire):
    """What a GPU node holds, outside any completion (after a warm-up load). After a `GpuWarm`
    order, `warm` names it (settled: done, or `error` says why not)."""

    type: Literal["residency"] = "residency"
    pool: str
    resident: list[ChunkServices]
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
