"""Prometheus metrics of the scheduler and the workers, and the endpoint that serves them.

Each process serves its own registry on 127.0.0.1 (`--metrics-port`, 0 = off). The deployment
assigns free ports and lists the endpoints in `<state_dir>/metrics.json` (Prometheus file_sd
format).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger("tangram.metrics")

ACT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.queued = Gauge(
            "tangram_queued_actions", "Actions waiting, per pool family", ["pool"], registry=r
        )
        # demand in the pool's own units (cores, GPUs, API slots): what an autoscaler sizes a pool
        # by (k8s/, docs/kubernetes.md); an action counts its smallest unit count
        self.queued_units = Gauge(
            "tangram_queued_units",
            "Units wanted by waiting actions (each its smallest unit count), per pool family",
            ["pool"],
            registry=r,
        )
        self.units_in_use = Gauge(
            "tangram_units_in_use", "Units held by running actions", ["pool"], registry=r
        )
        self.units_total = Gauge("tangram_units_total", "Units of the pool", ["pool"], registry=r)
        self.dispatched = Counter("tangram_dispatched_total", "Actions dispatched", ["pool"], registry=r)
        self.completed = Counter(
            "tangram_completed_total", "Actions completed", ["kind", "status"], registry=r
        )
        self.act = Histogram(
            "tangram_act_seconds",
            "Action completion time (queue + exec)",
            ["kind"],
            buckets=ACT_BUCKETS_S,
            registry=r,
        )
        self.queue = Histogram(
            "tangram_queue_seconds", "Time from submit to start", ["kind"], buckets=ACT_BUCKETS_S, registry=r
        )
        self.retries = Counter("tangram_retries_total", "Actions retried after a worker loss", registry=r)
        self.reroutes = Counter("tangram_reroutes_total", "Actions re-routed off an offline pool", registry=r)
        self.rejected = Counter("tangram_rejected_total", "Actions rejected at intake", registry=r)
        self.cancelled = Counter(
            "tangram_cancelled_total", "Actions cancelled by their caller before dispatch", registry=r
        )
        self.pools_offline = Gauge("tangram_pools_offline", "Pools with no live worker", registry=r)
        # nodes join and leave at run time (`scheduler/service/nodes.py`)
        self.nodes = Gauge(
            "tangram_nodes", "CPU/GPU nodes, per kind and state", ["kind", "state"], registry=r
        )
        self.node_units = Gauge(
            "tangram_node_units",
            "Units of a node (cores, GPUs): total and in use",
            ["node", "what"],
            registry=r,
        )
        self.loans = Counter(
            "tangram_core_loans_total", "Core loan changes sent to CPU workers", ["pool"], registry=r
        )
        self.batch_joins = Counter(
            "tangram_cpu_batch_joins_total",
            "CPU riders queued behind a batch that was already running on their cores",
            ["pool"],
            registry=r,
        )
        self.time_shares = Counter(
            "tangram_time_shares_total",
            "Actions started time-sharing cores held by a running action",
            ["pool"],
            registry=r,
        )
        self.warm_orders = Counter(
            "tangram_warm_orders_total",
            "Warm GPU restores (load) and retirements (unload) sent",
            ["op"],
            registry=r,
        )
        self.evictions = Counter(
            "tangram_sandbox_evictions_total",
            "Idle trajectories evicted to make room for an action (CPU memory is a cache)",
            registry=r,
        )
        self.sandboxes_lost = Counter(
            "tangram_sandboxes_lost_total",
            "Idle trajectories released because their sandbox was gone (worker restarted or lost)",
            registry=r,
        )
        # issue 37: labelled by tenant name only (never an action's ids or payload)
        self.tenant_actions = Gauge(
            "tangram_tenant_actions",
            "Actions per tenant: queued, running, held (queued but held back by its caps)",
            ["tenant", "state"],
            registry=r,
        )
        self.decision = Histogram(
            "tangram_decision_seconds",
            "Policy decision time per round",
            buckets=(1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.5),
            registry=r,
        )


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.outcomes = Counter(
            "tangram_worker_outcomes_total",
            "Action outcomes (sandbox statuses)",
            ["pool", "status"],
            registry=r,
        )
        self.exec = Histogram(
            "tangram_worker_exec_seconds", "Execution time", ["pool"], buckets=ACT_BUCKETS_S, registry=r
        )
        self.duplicates = Counter(
            "tangram_worker_skipped_total", "Deliveries skipped (duplicate/superseded)", ["pool"], registry=r
        )
        self.evictions = Counter(
            "tangram_gpu_evictions_total", "Reward services evicted from a GPU chunk", ["node"], registry=r
        )
        self.restores = Counter(
            "tangram_gpu_restores_total", "Reward services loaded cold on demand", ["node"], registry=r
        )
        self.host_restores = Counter(
            "tangram_gpu_host_restores_total",
            "Reward services restored on demand from host memory (the host tier)",
            ["node"],
            registry=r,
        )
        self.offloads = Counter(
            "tangram_gpu_offloads_total",
            "Evicted reward services kept in host memory (the host tier)",
            ["node"],
            registry=r,
        )
        self.warm_loads = Counter(
            "tangram_gpu_warm_loads_total",
            "Reward services loaded ahead of requests (warm-up at start)",
            ["node"],
            registry=r,
        )


def serve(registry: CollectorRegistry, port: int, addr: str = "127.0.0.1") -> None:
    """Serve `registry` on `addr`:`port` in a background thread (no-op when port is 0).

    Loopback by default; a container that Prometheus scrapes from outside passes 0.0.0.0 and
    publishes the port only on the network it trusts."""
    if not port:
        return
    for attempt in range(5):
        try:
            start_http_server(port, addr=addr, registry=registry)
            return
        except OSError as e:  # taken meanwhile (the deployment picked it free a moment ago)
            if attempt == 4:
                # metrics are not worth the process: it serves its pool without them
                log.error(
                    "metrics endpoint %s:%d not served (%s); this process runs without it", addr, port, e
                )
                return
            time.sleep(0.2)


def write_targets(state_dir: str | Path, targets: dict[str, int]) -> Path:
    """Prometheus file_sd targets for the local processes ({process name: port})."""
    path = Path(state_dir) / "metrics.json"
    path.write_text(
        json.dumps(
            [
                {"targets": [f"127.0.0.1:{p}"], "labels": {"process": name}}
                for name, p in sorted(targets.items())
            ],
            indent=2,
        )
    )
    return path
