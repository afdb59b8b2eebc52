"""Workload generators for the paper's scenarios: AI coding, MOPD, DeepSearch.

Each generator is a pure function of its parameters and a seed. All parameters are listed with
their justification in docs/simulator.md and can be overridden from configs/sim/*.yaml.
Durations are lognormal with the given mean and log-space sigma; every policy sees the same
trajectories (same seed) and only a per-kind prior of their durations.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field
from typing import Any

from scheduler.duration import Amdahl, Table
from scheduler.estimator import Prior
from scheduler.model import ResourceKind
from scheduler.sim.cluster import ApiSpec, ClusterSpec, ExecParams
from scheduler.sim.node_events import NodeEvent, spot_events
from scheduler.sim.workload import SimAction, SimTrajectory, Step

# Tensor-parallel speed-up of a short prefill-heavy scoring call (E(m) per GPU count).
TP_EFFICIENCY = ((1, 1.0), (2, 0.85), (4, 0.7), (8, 0.5))


def lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    """A lognormal sample with the given *mean* (not median) and log-space sigma."""
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)


@dataclass(frozen=True)
class CodingParams:
    """AI coding (SWE-style): turns of LLM think + tool execution, then a test-suite reward."""

    batch: int = 1280
    turns_min: int = 5
    turns_max: int = 25
    think_mean_s: float = 8.0
    think_sigma: float = 0.8
    shell_share: float = 0.7  # rigid 1-core commands (ls, grep, edits, small scripts)
    shell_mean_s: float = 2.0
    shell_sigma: float = 1.0
    run_units_max: int = 8  # mid-trajectory test/build runs, elastic 1..8
    run_mean_s: float = 10.0
    run_sigma: float = 1.0
    run_p: float = 0.8
    tests_units_max: int = 32  # final reward: the repository's test suite, elastic 1..32
    tests_mean_s: float = 300.0
    tests_sigma: float = 0.8
    tests_p: float = 0.97
    tests_malleable: bool = True  # given as test cases: the runner's workers can join mid-run
    memory_mb: int = 4_096  # sandbox container, held for the trajectory's life
    seed: int = 1


@dataclass(frozen=True)
class MopdParams:
    """Multi-teacher on-policy distillation: each call scores a sample with one teacher."""

    batch: int = 2048
    services: int = 10
    skew_ratio: float = 1000.0  # most / least called teacher (the paper: counts vary 1000x)
    turns_min: int = 1
    turns_max: int = 3
    think_mean_s: float = 30.0
    think_sigma: float = 0.7
    call_mean_s: float = 0.6  # at one GPU
    call_sigma: float = 0.5
    model_mb: tuple[int, ...] = (
        16_000,
        16_000,
        16_000,
        16_000,
        16_000,
        28_000,
        28_000,
        64_000,
        64_000,
        64_000,
    )
    seed: int = 2


@dataclass(frozen=True)
class DeepSearchParams:
    """DeepSearch (BrowseComp-like): quota-limited search calls, then a judge model."""

    batch: int = 2048
    turns_min: int = 5
    turns_max: int = 20
    think_mean_s: float = 6.0
    think_sigma: float = 0.6
    call_mean_s: float = 1.5
    call_sigma: float = 0.5
    api_max_concurrency: int = 128
    api_quota_per_window: int = 6_000  # 100 calls/s over a 60 s window
    api_window_s: float = 60.0
    judge_mean_s: float = 2.0
    judge_sigma: float = 0.4
    judge_model_mb: int = 16_000
    seed: int = 3


@dataclass
class Scenario:
    """A generated workload with the cluster it runs on and what the policies may know."""

    name: str
    trajectories: list[SimTrajectory]
    cluster: ClusterSpec
    priors: dict[str, Prior]
    model_mb: dict[str, int] = field(default_factory=dict)
    exec_params: ExecParams = field(default_factory=ExecParams)
    node_events: list[NodeEvent] = field(default_factory=list)  # nodes joining and leaving

    @property
    def num_actions(self) -> int:
        return sum(len(t.steps) for t in self.trajectories)


def coding(p: CodingParams | None = None, cluster: ClusterSpec | None = None) -> Scenario:
    p = p or CodingParams()
    rng = random.Random(p.seed)
    trajs = []
    for i in range(p.batch):
        steps = []
        for _ in range(rng.randint(p.turns_min, p.turns_max)):
            think = lognormal(rng, p.think_mean_s, p.think_sigma)
            if rng.random() < p.shell_share:
                t1 = lognormal(rng, p.shell_mean_s, p.shell_sigma)
                act = SimAction("shell", ResourceKind.CPU, (1,), t1, Amdahl(0.0), memory_mb=p.memory_mb)
            else:
                t1 = lognormal(rng, p.run_mean_s, p.run_sigma)
                act = SimAction(
                    "run",
                    ResourceKind.CPU,
                    tuple(range(1, p.run_units_max + 1)),
                    t1,
                    Amdahl(p.run_p),
                    memory_mb=p.memory_mb,
                )
            steps.append(Step(think, act))
        think = lognormal(rng, p.think_mean_s, p.think_sigma)
        t1 = lognormal(rng, p.tests_mean_s, p.tests_sigma)
        steps.append(
            Step(
                think,
                SimAction(
                    "tests",
                    ResourceKind.CPU,
                    tuple(range(1, p.tests_units_max + 1)),
                    t1,
                    Amdahl(p.tests_p),
                    memory_mb=p.memory_mb,
                    malleable=p.tests_malleable,
                ),
            )
        )
        trajs.append(SimTrajectory(f"c{i}", 0.0, tuple(steps)))
    priors = {
        "shell": Prior(p.shell_mean_s, 0.0),
        "run": Prior(p.run_mean_s, p.run_p),
        "tests": Prior(p.tests_mean_s, p.tests_p),
    }
    return Scenario("coding", trajs, cluster or ClusterSpec(cpu_nodes=15), priors)  # the paper's testbed


def gpu_call(service: str, t1_s: float, model_mb: int) -> SimAction:
    """A scoring call to `service`: elastic over buddy chunks 1/2/4/8 with the TP curve."""
    return SimAction(
        f"reward:{service}",
        ResourceKind.GPU,
        (1, 2, 4, 8),
        t1_s,
        Table(TP_EFFICIENCY),
        target=service,
        gpu_memory_mb=model_mb,
    )


def service_weights(n: int, skew_ratio: float) -> list[float]:
    """Geometric call shares, most popular first, with first/last = `skew_ratio`."""
    r = skew_ratio ** (-1.0 / (n - 1)) if n > 1 else 1.0
    w = [r**k for k in range(n)]
    total = sum(w)
    return [x / total for x in w]


def mopd(p: MopdParams | None = None, cluster: ClusterSpec | None = None) -> Scenario:
    p = p or MopdParams()
    p = dataclasses.replace(p, model_mb=tuple(p.model_mb))
    rng = random.Random(p.seed)
    names = [f"teacher{k}" for k in range(p.services)]
    sizes = [p.model_mb[k % len(p.model_mb)] for k in range(p.services)]
    order = list(range(p.services))
    rng.shuffle(order)  # popularity independent of model size
    weights = service_weights(p.services, p.skew_ratio)
    popular = [names[k] for k in order]
    size_of = dict(zip(names, sizes, strict=True))
    trajs = []
    for i in range(p.batch):
        steps = []
        for _ in range(rng.randint(p.turns_min, p.turns_max)):
            think = lognormal(rng, p.think_mean_s, p.think_sigma)
            svc = rng.choices(popular, weights)[0]
            t1 = lognormal(rng, p.call_mean_s, p.call_sigma)
            steps.append(Step(think, gpu_call(svc, t1, size_of[svc])))
        trajs.append(SimTrajectory(f"m{i}", 0.0, tuple(steps)))
    priors = {f"reward:{n}": Prior(p.call_mean_s, 0.0) for n in names}
    spec = cluster or ClusterSpec(cpu_nodes=0, gpus_total=40)
    return Scenario("mopd", trajs, spec, priors, dict(zip(names, sizes, strict=True)))


def deepsearch(p: DeepSearchParams | None = None, cluster: ClusterSpec | None = None) -> Scenario:
    p = p or DeepSearchParams()
    rng = random.Random(p.seed)
    trajs = []
    for i in range(p.batch):
        steps = []
        for _ in range(rng.randint(p.turns_min, p.turns_max)):
            think = lognormal(rng, p.think_mean_s, p.think_sigma)
            t1 = lognormal(rng, p.call_mean_s, p.call_sigma)
            steps.append(
                Step(think, SimAction("api:search", ResourceKind.API, (1,), t1, target="search", api_quota=1))
            )
        think = lognormal(rng, p.think_mean_s, p.think_sigma)
        t1 = lognormal(rng, p.judge_mean_s, p.judge_sigma)
        steps.append(Step(think, gpu_call("judge", t1, p.judge_model_mb)))
        trajs.append(SimTrajectory(f"d{i}", 0.0, tuple(steps)))
    api = ApiSpec(p.api_max_concurrency, p.api_quota_per_window, p.api_window_s)
    spec = cluster or ClusterSpec(cpu_nodes=0, gpus_total=8, apis={"search": api})
    priors = {"api:search": Prior(p.call_mean_s), "reward:judge": Prior(p.judge_mean_s)}
    return Scenario("deepsearch", trajs, spec, priors, {"judge": p.judge_model_mb})


@dataclass(frozen=True)
class SweImagesParams:
    """SWE-style coding in per-task container images (issue 36): `tasks` distinct images, each
    the environment of `group` trajectories (GRPO: n rollouts of one task), the turns of
    `CodingParams` (its defaults), on nodes that fetch images over their link into a store with
    a disk budget (LRU eviction of unused images, `scheduler.images`).

    Sources for the image figures:
    - SWE-bench Verified: 500 task instances over 12 repositories, one Docker image each; pulled
      from Docker Hub they are "more than 100 GiB of compressed layers" expanding into 240 GiB of
      local storage, and the pull "takes anywhere from half an hour to several hours" even with
      a fast connection (LogicStar, "How We Made SWE-Bench 50x Smaller",
      https://logicstar.ai/blog/how-we-made-swe-bench-50x-smaller). inspect_evals issue #926
      puts the Verified split at ~280 GB of images (and SWE-Lancer at ~14 GB per image).
    - The SWE-bench harness builds ~60 environment images, "100GB of images" (SWE-bench
      docs/20240627_docker/README.md): ~1.7 GB per environment, the bulk of what a node without
      the task's layers must fetch. Hence image sizes: lognormal, mean `image_mean_mb` 1,700 MB,
      log-space sigma 0.5 (task images of one repository differ little, repositories differ).
    - Fetch rate: 100 GiB of compressed layers in half an hour is ~57 MB/s compressed, ~135 MB/s
      of image on disk; `image_mb_per_s` 125 MB/s per node (1 Gbit/s, the image's size on
      disk), one fetch at a time per node (the kubelet's default `serializeImagePulls`).
    - Store budget: `image_store_mb` 100 GB per node (the SWE-bench harness asks for ~120 GB
      free for its images), below the 64 tasks' ~109 GB, so nodes cannot hold every image.
    - Scale: 64 tasks x 8 rollouts = 512 trajectories (a GRPO step over 64 of Verified's 500
      tasks) on 8 nodes of 128 cores: 2 cores per trajectory (the paper's testbed has 3, 1280
      trajectories on 15 x 256 cores). Nodes start with no image (a fresh step's cold cluster).
    """

    tasks: int = 64
    group: int = 8
    image_mean_mb: float = 1_700.0
    image_sigma: float = 0.5
    image_store_mb: int = 100_000
    image_mb_per_s: float = 125.0
    cpu_nodes: int = 8
    cores_per_node: int = 128
    memory_mb_per_node: int = 2_400_000  # the paper's 2.4 TB; less: sandboxes are evicted
    seed: int = 5


def swe_images(p: SweImagesParams | None = None, cluster: ClusterSpec | None = None) -> Scenario:
    """`coding`'s trajectories (its defaults, `tasks * group` of them), trajectory i in the image
    of task i // group, on `cpu_nodes` nodes with image stores."""
    p = p or SweImagesParams()
    rng = random.Random(p.seed)
    sizes = [max(1, round(lognormal(rng, p.image_mean_mb, p.image_sigma))) for _ in range(p.tasks)]
    spec = cluster or ClusterSpec(
        cpu_nodes=p.cpu_nodes,
        cores_per_node=p.cores_per_node,
        memory_mb_per_node=p.memory_mb_per_node,
        image_store_mb=p.image_store_mb,
        image_mb_per_s=p.image_mb_per_s,
    )
    base = coding(CodingParams(batch=p.tasks * p.group, seed=p.seed), spec)
    trajs = []
    for i, t in enumerate(base.trajectories):
        k = i // p.group
        image = f"swe/task{k:03d}:latest"
        steps = tuple(
            Step(s.think_s, dataclasses.replace(s.action, image=image, image_mb=sizes[k])) for s in t.steps
        )
        trajs.append(SimTrajectory(t.trajectory_id, t.start_s, steps))
    return Scenario("swe-images", trajs, spec, base.priors)


@dataclass(frozen=True)
class MixedParams:
    """Coding and reward scoring on one cluster (issue 39's scale run): `coding_batch` coding
    trajectories (`CodingParams`' turns) and `mopd_batch` scoring trajectories (`MopdParams`'
    teachers), each starting at a uniform time in [0, `arrival_s`), as successive rollout
    steps of many jobs arrive. The defaults make about 10^6 actions: 16 per coding trajectory
    (15 turns and the test suite on average), 2 per scoring one, on 100 nodes of 256 cores
    (about half their cores busy) and 20 nodes of 8 GPUs."""

    coding_batch: int = 50_000
    mopd_batch: int = 100_000
    arrival_s: float = 1_800.0
    cpu_nodes: int = 100
    gpu_nodes: int = 20
    seed: int = 7


def mixed(p: MixedParams | None = None, cluster: ClusterSpec | None = None) -> Scenario:
    p = p or MixedParams()
    spec = cluster or ClusterSpec(cpu_nodes=p.cpu_nodes, gpus_total=8 * p.gpu_nodes)
    code = coding(CodingParams(batch=p.coding_batch, seed=p.seed), spec)
    score = mopd(MopdParams(batch=p.mopd_batch, seed=p.seed + 1), spec)
    rng = random.Random(p.seed)
    trajs = [
        dataclasses.replace(t, start_s=rng.uniform(0.0, p.arrival_s))
        for t in (*code.trajectories, *score.trajectories)
    ]
    return Scenario("mixed", trajs, spec, {**code.priors, **score.priors}, score.model_mb)


@dataclass(frozen=True)
class SpotParams:
    """`coding` (its defaults) on `cpu_nodes` nodes that come and go (issue 39): the last
    `spot_nodes` are spot nodes, preempted (lost) one every `every_s` from `lost_at_s`, each
    back `down_s` later; `drain_nodes` more are drained for maintenance at `drain_at_s` and
    back `down_s` later; `join_nodes` new nodes join at `join_at_s` (an autoscaler)."""

    batch: int = 1280
    cpu_nodes: int = 15
    spot_nodes: int = 3
    lost_at_s: float = 60.0
    every_s: float = 30.0
    down_s: float = 120.0
    drain_nodes: int = 2
    drain_at_s: float = 90.0
    join_nodes: int = 2
    join_at_s: float = 150.0
    seed: int = 1


def spot(p: SpotParams | None = None, cluster: ClusterSpec | None = None) -> Scenario:
    p = p or SpotParams()
    sc = coding(CodingParams(batch=p.batch, seed=p.seed), cluster or ClusterSpec(cpu_nodes=p.cpu_nodes))
    sc.name = "spot"
    n = sc.cluster.cpu_nodes
    sc.node_events = spot_events(
        n,
        p.spot_nodes,
        p.lost_at_s,
        p.every_s,
        p.down_s,
        p.drain_nodes,
        p.drain_at_s,
        p.join_nodes,
        p.join_at_s,
    )
    return sc


PARAMS: dict[str, type] = {
    "coding": CodingParams,
    "mopd": MopdParams,
    "deepsearch": DeepSearchParams,
    "swe-images": SweImagesParams,
    "mixed": MixedParams,
    "spot": SpotParams,
}
GENERATORS = {
    "coding": coding,
    "mopd": mopd,
    "deepsearch": deepsearch,
    "swe-images": swe_images,
    "mixed": mixed,
    "spot": spot,
}


def build(name: str, overrides: dict[str, Any] | None = None, cluster: ClusterSpec | None = None) -> Scenario:
    """Generate scenario `name` with parameter `overrides` (unknown keys are an error)."""
    cls = PARAMS[name]
    known = {f.name for f in dataclasses.fields(cls)}
    bad = set(overrides or {}) - known
    if bad:
        raise ValueError(f"unknown {name} parameters {sorted(bad)}; known: {sorted(known)}")
    params = cls(**(overrides or {}))
    return GENERATORS[name](params, cluster)  # type: ignore[operator]
