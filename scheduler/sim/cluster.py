"""Cluster specs (the paper's testbed shapes) and the execution-cost parameters of the simulator.

Every number here is an assumption and is listed, with its source, in docs/simulator.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.images import ImageStore
from scheduler.resources import ApiPool, ClusterState, CpuNode, GpuNode


@dataclass(frozen=True, slots=True)
class ApiSpec:
    """A provider's limits: concurrent calls and quota tokens per window."""

    max_concurrency: int | None = None
    quota_per_window: int | None = None
    window_s: float = 60.0


@dataclass(frozen=True)
class ClusterSpec:
    """Pools to build. GPUs: `gpus_total` split into nodes of `gpus_per_node` (last one smaller).

    `host_memory_mb`: each GPU node's host memory for service instances (MiB for the node; the
    host tier of `scheduler.gpu_cache`). None: unlimited, every service backed up in host memory
    on every chunk from the start (the paper's assumption, and the default).
    """

    cpu_nodes: int = 5
    cores_per_node: int = 256
    numa_groups: int = 2
    memory_mb_per_node: int = 2_400_000  # 2.4 TB per node, as in the paper's testbed
    gpus_total: int = 0
    gpus_per_node: int = 8
    gpu_memory_mb: int = 81_920  # 80 GB Hopper
    host_memory_mb: int | None = None
    apis: dict[str, ApiSpec] = field(default_factory=dict)
    # each CPU node's image store (`scheduler.images`): its disk budget (MB; None: unbounded)
    # and its link's fetch rate (MB/s); 0: no store, as before images
    image_store_mb: int | None = None
    image_mb_per_s: float = 0.0

    def gpu_node_sizes(self) -> list[int]:
        full, rest = divmod(self.gpus_total, self.gpus_per_node)
        return [self.gpus_per_node] * full + ([rest] if rest else [])

    def build(self) -> ClusterState:
        """A fresh, all-free `ClusterState` of this shape."""
        cpu = {
            f"cpu{i}": CpuNode.uniform(
                f"cpu{i}", self.cores_per_node, self.memory_mb_per_node, self.numa_groups
            )
            for i in range(self.cpu_nodes)
        }
        if self.image_mb_per_s > 0:
            for node in cpu.values():
                node.store = ImageStore(self.image_store_mb, self.image_mb_per_s)
        gpu = {
            f"gpu{i}": GpuNode(f"gpu{i}", n, self.gpu_memory_mb) for i, n in enumerate(self.gpu_node_sizes())
        }
        api = {
            name: ApiPool(name, s.max_concurrency, s.quota_per_window, s.window_s)
            for name, s in self.apis.items()
        }
        return ClusterState(cpu=cpu, gpu=gpu, api=api)


@dataclass(frozen=True)
class ExecParams:
    """Costs of executing what the policy decided; the same for every policy.

    exec_overhead_s: per CPU action (`docker exec` into a warm container, ~0.1 s measured).
    sandbox_start_s: once per trajectory, on its first CPU action (cold `docker run`, ~0.3 s).
    restore_*: a host-tier restore: the weights of an instance whose process was kept in host
        memory are copied back to its GPUs (evict on execution; `Tier.HOST`). Fixed part 0.5 s
        (re-attaching the process's CUDA allocations and the server's model-ready handshake,
        an estimate); then the shard of each GPU over its own host-to-device link, in parallel,
        at 20,000 MB/s: PCIe Gen4 x16 is 32 GB/s raw, ~25 GB/s after encoding and protocol,
        and `cudaMemcpy` from pinned memory measures ~20-22 GB/s (NVIDIA `bandwidthTest`; the
        A100/H100 hosts of DGX A100). Gen5 x16 hosts (H100/H200 HGX) measure ~50 GB/s, so this
        is conservative there: a 16 GB model on one GPU restores in 0.5 + 0.8 s.
    cold_*: a cold load (`Tier.COLD`): process start and framework import (torch, the serving
        stack: 2 s fixed, measured 4.8 s on this project's CPU-only test host for a tiny model,
        less on a server with warm page cache), then the weights read from local NVMe at
        5,000 MB/s (one PCIe Gen4 NVMe SSD: ~7 GB/s sequential, lower through a filesystem and
        safetensors parsing) and copied to the GPUs. Paid by the cold-start baseline on every
        load, and by evict on execution for an instance the host tier does not hold.
    host_process_mb: host memory of an instance beyond its weights, per GPU of its chunk (the
        serving process with torch and a CUDA context, ~1 GiB resident); an instance holds
        its model's weights (pinned, for the copy) plus this in its node's `host_memory_mb`.
    gpu_activation_mb: per-GPU memory of a service beyond its weight shard (KV, activations).
    api_reject_s: time for a provider to answer an over-limit call with a rate-limit error.
    batch_amortised_share: the share of a call's time that a continuously batching server
        (a `dedicated-gpu` group serving several calls at once) amortises over the calls it runs
        together: k calls run at k / (1 + (k - 1) * (1 - share)) times one call's throughput
        (1.25x at most with 0.2; 0: processor sharing, no gain).
    round_gap_s: minimum time between two scheduling rounds (0: a round at every event time).
    max_batch: the largest batch one call of a reward service scores (the live deployment's
        `reward_models[].max_batch`): a GPU allocation takes along up to `max_batch - 1`
        waiting calls of its service as riders (`scheduler.round`), run as one batch at the
        gain of `batch_amortised_share`. 1 (the default): no riders, each call runs alone.
    """

    exec_overhead_s: float = 0.1
    sandbox_start_s: float = 0.3
    restore_fixed_s: float = 0.5
    restore_mb_per_s: float = 20_000.0
    cold_fixed_s: float = 2.0
    cold_mb_per_s: float = 5_000.0
    host_process_mb: int = 1_024
    gpu_activation_mb: int = 4_096
    api_reject_s: float = 0.1
    batch_amortised_share: float = 0.2
    round_gap_s: float = 0.0
    max_batch: int = 1

    def footprint_mb(self, model_mb: int, units: int) -> int:
        return model_mb // units + self.gpu_activation_mb

    def host_footprint_mb(self, model_mb: int, units: int) -> int:
        """Host memory of one instance: all its shards' weights and one process per GPU."""
        return model_mb + units * self.host_process_mb

    def restore_s(self, model_mb: int, units: int) -> float:
        """Shards are copied to the `units` GPUs in parallel."""
        return self.restore_fixed_s + model_mb / units / self.restore_mb_per_s

    def cold_load_s(self, model_mb: int, units: int) -> float:
        return self.cold_fixed_s + model_mb / units / self.cold_mb_per_s
