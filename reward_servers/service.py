"""The reward service of one GPU node: the API the GPU worker calls.

    svc = RewardService(cfg, node="gpu0")       # or attach=True after `tangram reward deploy`
    svc.start()
    scores = svc.score("rm", [{"prompt": ..., "response": ...}, ...], chunk=(0,))
    svc.stop()

`score` takes every request for one model that waited together and sends them as batches to a
replica of the (model, DoP) service on the chunk, restoring, loading and evicting replicas on
demand (evicted replicas stay in host memory within the node's `host_memory_mb`: issue 38). A crashed
tritonserver is detected (by the monitor thread or a failed call), restarted, and the call retried
once; failures that remain raise a `RewardServerError` subclass whose `retryable` tells the
worker whether to retry the actions elsewhere.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from reward_servers import client
from reward_servers.backends import input_errors
from reward_servers.backends.rules import verify
from reward_servers.control import control_dir
from reward_servers.errors import InferenceFailed, InputRejected, ModelLoadFailed, TritonCrashed
from reward_servers.naming import parse_name
from reward_servers.placement import Placement, ScalingPlan, ScalingPolicy
from reward_servers.profile import DopProfile, batch_tokens
from reward_servers.replicas import ReplicaManager
from reward_servers.repository import build_repository
from reward_servers.triton import ServerInfo, TritonController, TritonServer
from scheduler.gpu_cache import Tier
from tangram_celery.common.config import GpuNodeConfig, RewardModelConfig, TangramConfig
from tangram_celery.common.errors import RewardServerError

log = logging.getLogger(__name__)


class Traced(NamedTuple):
    """A scored call (`RewardService.score_traced`): its results, the scoring's seconds, and
    what its lease paid before: the tier its replica's weights came from and how long that took."""

    results: list[dict[str, Any]]
    exec_s: float
    tier: Tier
    load_s: float


def validate_request(cfg: TangramConfig, model: str, inputs: Any) -> str | None:
    """Why a reward action for `model` with `inputs` must be rejected at submit, or None if valid."""
    m = cfg.reward_model(model)
    if m is None:
        known = sorted(r.name for r in cfg.reward_models)
        return f"unknown reward model {model!r}; declared: {known}"
    errors = input_errors(m.backend, inputs)
    return f"model {model!r}: " + "; ".join(errors) if errors else None


def node_dir(cfg: TangramConfig, node: str) -> Path:
    """Where the repository, logs and server.json of `node` live."""
    return Path(cfg.state_dir).resolve() / "reward" / node


class RewardService:
    """Triton server + replica manager + DoP profiles of one GPU node."""

    def __init__(
        self,
        cfg: TangramConfig,
        node: str | None = None,
        *,
        attach: bool = False,
        policy: ScalingPolicy = ScalingPolicy(),
        profiles: Mapping[str, DopProfile] | None = None,
        cpu_threads: int = 1,
        monitor_interval_s: float | None = 2.0,
        retries_on_crash: int = 1,
    ) -> None:
        nodes = {n.name: n for n in cfg.nodes.gpu}
        if not nodes:
            raise InputRejected("the config declares no GPU node (nodes.gpu)")
        self.cfg = cfg
        self.node: GpuNodeConfig = nodes[node] if node else next(iter(nodes.values()))
        self.models: dict[str, RewardModelConfig] = {m.name: m for m in cfg.reward_models}
        self.work_dir = node_dir(cfg, self.node.name)
        self.attach = attach
        self.policy = policy
        self.profiles = dict(profiles or {})
        self.cpu_threads = cpu_threads
        self.monitor_interval_s = monitor_interval_s
        self.retries_on_crash = retries_on_crash
        self.server: TritonServer | None = None
        self.controller: TritonController | None = None
        self.manager: ReplicaManager | None = None
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        # Held across a whole recovery (restart, retarget, forget replicas), so a caller never sees
        # the new server with the dead one's replica table.
        self._recovery = threading.Lock()

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> RewardService:
        """Write the repository and start tritonserver (or attach to the deployed one)."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        info_path = self.work_dir / "server.json"
        if self.attach:
            if not info_path.exists():
                raise TritonCrashed(
                    f"no deployed server for node {self.node.name!r}; run `tangram reward deploy`"
                )
            self.server = TritonServer.attach(ServerInfo.load(info_path), self.work_dir)
        else:
            build_repository(
                self.models.values(), self.node, self.work_dir / "repo", cpu_threads=self.cpu_threads
            )
            self.server = TritonServer(self.work_dir / "repo", self.work_dir)
            self.server.start()
        assert self.server.info is not None
        self.controller = TritonController.of(self.server.info, control=control_dir(self.work_dir / "repo"))
        memory = {name: m.memory_mb for name, m in self.models.items() if m.backend != "rule"}
        self.manager = ReplicaManager(
            self.controller,
            self.node.num_gpus,
            self.node.gpu_memory_mb,
            memory,
            host_memory_mb=self.node.host_budget_mb(),
            host_process_mb=self.node.host_process_mb,
            policy=self.policy,
        )
        if self.attach:
            ready = [n for n, state in self.controller.loaded().items() if state == "READY"]
            self.manager.adopt(ready)
        if self.monitor_interval_s:
            self._stop.clear()
            self._monitor = threading.Thread(target=self._watch, name="triton-monitor", daemon=True)
            self._monitor.start()
        return self

    def stop(self) -> None:
        """Stop the monitor and, unless attached to a deployed server, tritonserver."""
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout=10)
        if self.server is not None and not self.attach:
            self.server.stop()

    def __enter__(self) -> RewardService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- health -------------------------------------------------------------------------------
    def check(self) -> bool:
        """Restart tritonserver if it died (replicas then reload on demand); True if it restarted."""
        assert self.server is not None and self.controller is not None and self.manager is not None
        with self._recovery:
            restarted = self.server.ensure_running()
            if restarted:
                log.warning("tritonserver restarted (restart #%d)", self.server.restarts)
                assert self.server.info is not None
                self.controller.retarget(self.server.url, self.server.info.api_key)
                self.controller.forget_controls()
                self.manager.reset()
                if self.attach and self.server.info is not None:
                    self.server.info.save(self.work_dir / "server.json")
        return restarted

    def generation(self) -> int:
        """How many times the server was replaced; read between recoveries, never inside one."""
        assert self.server is not None
        with self._recovery:
            return self.server.restarts

    def _watch(self) -> None:
        assert self.monitor_interval_s
        while not self._stop.wait(self.monitor_interval_s):
            try:
                self.check()
            except Exception:  # keep watching; the next call reports the error
                log.exception("tritonserver health check failed")

    def health(self) -> dict[str, Any]:
        """Liveness, restart count, replica table and counters."""
        assert self.server is not None and self.manager is not None
        return {
            "node": self.node.name,
            "alive": self.server.alive(),
            "url": self.server.info.url if self.server.info else None,
            "pid": self.server.info.pid if self.server.info else None,
            "restarts": self.server.restarts,
            **self.manager.snapshot(),
        }

    # ---- scoring ------------------------------------------------------------------------------
    def validate(self, model: str, inputs: Sequence[Mapping[str, Any]]) -> RewardModelConfig:
        """The model's config; raises InputRejected naming the bad request and field."""
        for i, row in enumerate(inputs):
            why = validate_request(self.cfg, model, row)
            if why:
                raise InputRejected(f"request {i}: {why}")
        m = self.models.get(model)
        if m is None:
            raise InputRejected(f"unknown reward model {model!r}")
        return m

    def pick_dop(self, model: str, inputs: Sequence[Mapping[str, Any]], max_dop: int | None = None) -> int:
        """The DoP for this batch from the model's length profile (smallest option when unprofiled)."""
        m = self.models[model]
        prof = self.profiles.get(model)
        options = [d for d in m.dop_options if d <= self.node.num_gpus]
        if prof is None:
            return min(options)
        return prof.pick(batch_tokens(inputs), options, max_dop)

    def score(
        self,
        model: str,
        inputs: Sequence[Mapping[str, Any]],
        chunk: tuple[int, ...] | None = None,
        dop: int | None = None,
    ) -> list[dict[str, Any]]:
        """One result dict per request, in order: {'score': float} or {'logprobs': [...], ...}.

        `chunk` is the scheduler's GPU allocation (its size is the DoP); without it the DoP comes
        from `dop` or the length profile and the manager picks the chunk.
        """
        return self.score_timed(model, inputs, chunk, dop)[0]

    def score_timed(
        self,
        model: str,
        inputs: Sequence[Mapping[str, Any]],
        chunk: tuple[int, ...] | None = None,
        dop: int | None = None,
    ) -> tuple[list[dict[str, Any]], float]:
        """`score`, and the seconds the scoring itself took: the inference on the replica, without
        restoring (loading) it or waiting for it. This is what the scheduler's duration estimate
        learns from; a restore depends on where the call was placed, not on the call."""
        traced = self.score_traced(model, inputs, chunk, dop)
        return traced.results, traced.exec_s

    def score_traced(
        self,
        model: str,
        inputs: Sequence[Mapping[str, Any]],
        chunk: tuple[int, ...] | None = None,
        dop: int | None = None,
    ) -> Traced:
        """`score_timed`, and what the call's lease paid: the tier its replica came from
        (DEVICE: resident; HOST: restored from host memory; COLD: loaded) and the seconds."""
        m = self.validate(model, inputs)
        rows = [dict(r) for r in inputs]
        if m.backend == "rule":
            assert m.rule is not None
            t0 = time.monotonic()
            return Traced([verify(m.rule, r) for r in rows], time.monotonic() - t0, Tier.DEVICE, 0.0)
        if not rows:
            return Traced([], 0.0, Tier.DEVICE, 0.0)
        dop = len(chunk) if chunk else dop or self.pick_dop(model, rows)
        if dop not in m.dop_options:
            raise InputRejected(f"model {model!r} has no DoP {dop} service; options {m.dop_options}")
        assert self.manager is not None and self.controller is not None
        for attempt in range(self.retries_on_crash + 1):
            generation = self.generation()
            try:
                with self.manager.lease_traced(model, dop, chunk) as (replica, tier, load_s):
                    t0 = time.monotonic()
                    out = client.infer(
                        self.controller, replica.name, rows, max_batch=m.max_batch, parallel=dop
                    )
                    return Traced(out, time.monotonic() - t0, tier, load_s)
            except TritonCrashed:
                if attempt == self.retries_on_crash:
                    raise
                self.check()  # restarts a dead server; raises if it cannot
            except (InferenceFailed, ModelLoadFailed):
                # The monitor replaced the server during this call: the replica it was leased went
                # with the old one (Triton answers 404 for it), so the call is a crash, not a bad
                # request.
                if self.generation() == generation or attempt == self.retries_on_crash:
                    raise
        raise AssertionError("unreachable")

    def score_many(
        self, requests: Sequence[tuple[str, Mapping[str, Any]]], chunk: tuple[int, ...] | None = None
    ) -> list[dict[str, Any]]:
        """Score (model, inputs) pairs: grouped per model into batched calls, results in input order."""
        groups: dict[str, list[int]] = {}
        for i, (model, _) in enumerate(requests):
            groups.setdefault(model, []).append(i)
        out: list[dict[str, Any]] = [{} for _ in requests]
        for model, idx in groups.items():
            for i, res in zip(idx, self.score(model, [requests[i][1] for i in idx], chunk), strict=True):
                out[i] = res
        return out

    def warm_services(self) -> list[tuple[str, int]]:
        """The (model, dop) services a fresh node warms: every Triton-served model at its
        smallest DoP that fits the node (the one a reward action is given when GPUs are short)."""
        out = []
        for m in self.models.values():
            dops = [d for d in m.dop_options if d <= self.node.num_gpus]
            if m.backend != "rule" and dops:
                out.append((m.name, min(dops)))
        return out

    def warm_up(self, on_loaded: Callable[[str], object] | None = None, parallel: int = 2) -> dict[str, Any]:
        """Load the configured services onto free chunks as memory allows, before any request
        (`placement.plan_warmup`; never evicts): first those that find no room on the GPUs into
        the host tier (loaded, then offloaded), then the GPUs' own, `parallel` loads at a time (a
        load is mostly the Triton stub importing torch: CPU-bound). Meant for a background thread at start: a
        request that arrives meanwhile waits for a replica being warmed instead of loading a
        second one. `on_loaded(replica)` is called after each load. Returns what was loaded and
        what failed; a failed load is logged and leaves its service to load on demand."""
        assert self.manager is not None
        manager = self.manager
        t0 = time.monotonic()
        loaded: list[str] = []
        failed: dict[str, str] = {}
        crashed = threading.Event()

        def warm(p: Placement) -> None:
            if crashed.is_set():
                return
            try:
                if not manager.warm(p):
                    return
            except TritonCrashed as e:
                crashed.set()  # the monitor restarts the server; replicas then load on demand
                failed[p.replica] = str(e)
                log.warning("warm-up stopped: %s", e)
                return
            except RewardServerError as e:
                failed[p.replica] = str(e)
                log.warning("warm-up of %s failed: %s", p.replica, e)
                return
            loaded.append(p.replica)
            log.info("warmed %s", p.replica)
            if on_loaded is not None:
                on_loaded(p.replica)

        plan = manager.plan_warm(self.warm_services())
        with ThreadPoolExecutor(max(1, parallel), thread_name_prefix="tangram-warm") as pool:
            # the host tier first, while the GPUs are free to load through; then the GPUs
            list(pool.map(warm, [p for p in plan if p.host]))
            list(pool.map(warm, [p for p in plan if not p.host]))
        return {"loaded": loaded, "failed": failed, "seconds": time.monotonic() - t0}

    def scale(self, demand: Mapping[tuple[str, int], int]) -> ScalingPlan:
        """One autoscaling round: (model, dop) -> queued requests at the worker."""
        assert self.manager is not None
        return self.manager.scale(demand)

    def resident(self) -> dict[tuple[int, ...], list[str]]:
        """chunk -> cached services (for the scheduler's GpuNode.resident)."""
        assert self.manager is not None
        return self.manager.resident()

    def resident_models(self) -> dict[tuple[int, ...], list[str]]:
        """What the scheduler places by: chunk -> models cached there, least recently used
        first. The chunk's size is the service's DoP, so the model name is enough."""
        return {chunk: [parse_name(s)[0] for s in services] for chunk, services in self.resident().items()}

    def host_resident_models(self) -> dict[tuple[int, ...], list[str]]:
        """chunk -> models whose replica there is kept in host memory only (restorable by a
        copy), least recently used first."""
        assert self.manager is not None
        return {
            chunk: [parse_name(s)[0] for s in services]
            for chunk, services in self.manager.host_resident().items()
        }
