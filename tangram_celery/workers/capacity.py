"""What a node can lend, as its worker finds it on the host and the operator caps it.

Detection reads text only (`/proc/meminfo`, cgroup v2 or v1 files, the NUMA nodes' cpulists,
`nvidia-smi`), under a `root` that tests point at a fake tree:
- cores: the process's affinity (`sched_getaffinity`) within the cgroup's effective cpuset,
  grouped by the NUMA nodes that hold them (one group when the host tells none);
- memory: `MemTotal` or the cgroup's `memory.max`, the smaller, less a margin for the worker
  itself and the system (`margin_mb`, at least `MARGIN_FRACTION` of it);
- GPUs: how many `nvidia-smi` lists (rounded down to a buddy size: 1, 2, 4, 8) and the memory
  of the smallest; none without `nvidia-smi` (the caller falls back on its defaults).

Precedence, highest first: the operator's flags (`Caps`: `tangram worker --cpuset --cores
--memory-mb --gpus --gpu-memory-mb`), the config's `nodes:` entry of the same name (the operator's
declaration, used as written: a test host may declare cores it splits between fake nodes),
then detection. `--cpuset` and `--cores` narrow the cores; the others replace the value.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tangram_celery.common.config import CpuNodeConfig, GpuNodeConfig

MARGIN_MB = 512  # memory kept back for the worker, its runner processes and the system
MARGIN_FRACTION = 0.05
GPU_SIZES = (8, 4, 2, 1)
NO_LIMIT = 1 << 60  # cgroup v1 writes a huge number for "no limit"

Groups = tuple[tuple[int, ...], ...]


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (sorted, unique; blank -> [])."""
    out: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return sorted(out)


def meminfo_total_mb(text: str) -> int:
    """MemTotal of a /proc/meminfo text, MiB (0 when absent)."""
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024  # kB
    return 0


def cgroup_limit_mb(text: str | None) -> int | None:
    """A cgroup memory limit ('max', bytes, or v1's huge no-limit number) in MiB; None: none."""
    if text is None or not text.strip() or text.strip() == "max":
        return None
    value = int(text.strip())
    return None if value >= NO_LIMIT else value >> 20


def group_by_numa(cores: Iterable[int], node_cpulists: Mapping[int, str]) -> Groups:
    """`cores` split by the NUMA node holding each (in node order); cores no node lists, and
    all of them when the host lists no node, form one more group."""
    left = sorted(set(cores))
    groups: list[tuple[int, ...]] = []
    for _, text in sorted(node_cpulists.items()):
        mine = set(parse_cpulist(text))
        group = tuple(c for c in left if c in mine)
        if group:
            groups.append(group)
            left = [c for c in left if c not in mine]
    if left:
        groups.append(tuple(left))
    return tuple(groups)


def parse_nvidia_smi(text: str) -> tuple[int, int]:
    """(GPUs, MiB of the smallest) from `nvidia-smi --query-gpu=memory.total
    --format=csv,noheader,nounits`; the count is rounded down to 1, 2, 4 or 8."""
    sizes = [int(float(line.strip())) for line in text.splitlines() if line.strip()]
    if not sizes:
        return 0, 0
    return buddy_size(len(sizes)), min(sizes)


def buddy_size(n: int) -> int:
    """The largest of 8, 4, 2, 1 that is at most `n` (0 for none)."""
    return next((s for s in GPU_SIZES if s <= n), 0)


@dataclass(frozen=True)
class HostCapacity:
    """What the host offers this worker: cores per NUMA group, memory (margin taken), GPUs."""

    numa: Groups
    memory_mb: int
    num_gpus: int = 0
    gpu_memory_mb: int = 0


@dataclass(frozen=True)
class Caps:
    """The operator's flags (None: not given)."""

    cpuset: tuple[int, ...] | None = None
    cores: int | None = None
    memory_mb: int | None = None
    gpus: int | None = None
    gpu_memory_mb: int | None = None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def detect(
    root: Path = Path("/"),
    affinity: Iterable[int] | None = None,
    nvidia_smi: str | None = None,
    margin_mb: int = MARGIN_MB,
) -> HostCapacity:
    """The host's capacity as read under `root` (see the module doc). `affinity`: the cores this
    process may run on (default `os.sched_getaffinity(0)`); `nvidia_smi`: its output, or None
    to run it when it is installed (and `root` is the real one)."""
    cores = set(affinity if affinity is not None else os.sched_getaffinity(0))
    cg = root / "sys/fs/cgroup"
    cpuset = _read(cg / "cpuset.cpus.effective") or _read(cg / "cpuset/cpuset.effective_cpus")
    if cpuset and cpuset.strip():
        cores &= set(parse_cpulist(cpuset))
    nodes: dict[int, str] = {}
    for d in sorted((root / "sys/devices/system/node").glob("node[0-9]*")):
        text = _read(d / "cpulist")
        if text is not None:
            nodes[int(d.name[4:])] = text
    total = meminfo_total_mb(_read(root / "proc/meminfo") or "")
    limit = cgroup_limit_mb(_read(cg / "memory.max") or _read(cg / "memory/memory.limit_in_bytes"))
    memory = min(total, limit) if limit is not None and total else (limit or total)
    memory = max(0, memory - max(margin_mb, int(memory * MARGIN_FRACTION)))
    if nvidia_smi is None and root == Path("/"):
        nvidia_smi = _nvidia_smi()
    gpus, gpu_mb = parse_nvidia_smi(nvidia_smi or "")
    return HostCapacity(group_by_numa(cores, nodes), memory, gpus, gpu_mb)


def _nvidia_smi() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        return subprocess.run(
            [exe, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def narrow(groups: Groups, cpuset: Sequence[int] | None, cores: int | None) -> Groups:
    """`groups` kept to `cpuset` (when given), then to the first `cores` cores, group by
    group (so that a cap keeps whole NUMA groups where it can). Empty groups are dropped."""
    if cpuset is not None:
        keep = set(cpuset)
        groups = tuple(tuple(c for c in g if c in keep) for g in groups)
    if cores is not None:
        left, out = cores, []
        for g in groups:
            out.append(g[: max(0, left)])
            left -= len(out[-1])
        groups = tuple(out)
    return tuple(g for g in groups if g)


def cpu_capacity(
    name: str, host: HostCapacity, declared: CpuNodeConfig | None, caps: Caps
) -> tuple[Groups, int]:
    """(cores per NUMA group, memory MiB) CPU node `name` lends (see the module doc for the
    precedence). Raises ValueError when nothing is left to lend."""
    if declared is not None:
        groups, memory = declared.numa_split(), declared.memory_mb
    else:
        groups, memory = host.numa, host.memory_mb
    groups = narrow(groups, caps.cpuset, caps.cores)
    if caps.memory_mb is not None:
        memory = caps.memory_mb
    if not groups:
        raise ValueError(f"CPU node {name!r} has no core to lend (cpuset {caps.cpuset}, cores {caps.cores})")
    if memory < 64:
        raise ValueError(f"CPU node {name!r} has {memory} MiB to lend; give --memory-mb (at least 64)")
    return groups, memory


def gpu_capacity(
    name: str, host: HostCapacity, declared: GpuNodeConfig | None, caps: Caps, default_mb: int
) -> tuple[int, int]:
    """(GPUs, MiB per GPU) GPU node `name` lends: flags, else its `nodes.gpu` entry, else what
    `nvidia-smi` lists, else one GPU of `default_mb` (a CPU-kind Triton host)."""
    if declared is not None:
        gpus, mb = declared.num_gpus, declared.gpu_memory_mb
    elif host.num_gpus:
        gpus, mb = host.num_gpus, host.gpu_memory_mb
    else:
        gpus, mb = 1, default_mb
    if caps.gpus is not None:
        gpus = caps.gpus
    if caps.gpu_memory_mb is not None:
        mb = caps.gpu_memory_mb
    if gpus not in GPU_SIZES:
        raise ValueError(f"GPU node {name!r}: {gpus} GPUs; a node lends 1, 2, 4 or 8")
    return gpus, mb


def as_cpu_config(name: str, groups: Groups, memory_mb: int) -> CpuNodeConfig:
    """A `nodes.cpu` entry with the same core count, groups and memory (the worker's own
    settings read these; the host core ids travel in the node record)."""
    first = min(c for g in groups for c in g)
    cores = sum(len(g) for g in groups)
    return CpuNodeConfig(
        name=name, cores=cores, numa_groups=len(groups), memory_mb=memory_mb, core_offset=first
    )
