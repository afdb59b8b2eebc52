"""What a worker detects its node can lend (fake /proc and /sys trees), how the operator's flags
and the config's entry cap it, and the node name a worker takes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tangram_celery.common.config import CpuNodeConfig, GpuNodeConfig, parse_config
from tangram_celery.workers.capacity import (
    Caps,
    HostCapacity,
    cgroup_limit_mb,
    cpu_capacity,
    detect,
    gpu_capacity,
    group_by_numa,
    narrow,
    parse_cpulist,
    parse_nvidia_smi,
)
from tangram_celery.workers.membership import node_name, resolve_cpu, resolve_gpu


def fake_host(
    root: Path, *, cpuset: str | None, nodes: dict[int, str], mem_kb: int, memory_max: str | None
) -> Path:
    (root / "proc").mkdir(parents=True)
    (root / "proc/meminfo").write_text(f"MemTotal:       {mem_kb} kB\nMemFree:  1 kB\n")
    cg = root / "sys/fs/cgroup"
    cg.mkdir(parents=True)
    if cpuset is not None:
        (cg / "cpuset.cpus.effective").write_text(cpuset + "\n")
    if memory_max is not None:
        (cg / "memory.max").write_text(memory_max + "\n")
    for n, text in nodes.items():
        d = root / f"sys/devices/system/node/node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(text + "\n")
    return root


def test_cpulists_parse_ranges_and_singles() -> None:
    """A cpulist's ranges and single ids become a sorted list; a blank one none."""
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist(" \n") == []


def test_cores_are_the_affinity_within_the_cgroup_grouped_by_numa(tmp_path: Path) -> None:
    """Given 16 cores in 2 NUMA nodes, an affinity of 0-11 and a cgroup cpuset of 2-13, the node
    lends 2-11, as 2-7 and 8-11 (the NUMA nodes that hold them)."""
    root = fake_host(tmp_path, cpuset="2-13", nodes={0: "0-7", 1: "8-15"}, mem_kb=32 << 20, memory_max="max")
    host = detect(root, affinity=range(12), nvidia_smi="")
    assert host.numa == ((2, 3, 4, 5, 6, 7), (8, 9, 10, 11))


def test_memory_is_the_smaller_of_host_and_cgroup_less_a_margin(tmp_path: Path) -> None:
    """Given 32 GiB of host memory and a cgroup limit of 8 GiB, the node lends 8 GiB less the
    margin (512 MiB, or 5 % when larger); without a limit, the host's memory less 5 %."""
    limited = fake_host(tmp_path / "a", cpuset=None, nodes={}, mem_kb=32 << 20, memory_max=str(8 << 30))
    assert detect(limited, affinity=[0], nvidia_smi="").memory_mb == 8192 - 512
    free = fake_host(tmp_path / "b", cpuset=None, nodes={}, mem_kb=32 << 20, memory_max="max")
    host = detect(free, affinity=[0, 1], nvidia_smi="")
    assert host.memory_mb == 32768 - int(32768 * 0.05) and host.numa == ((0, 1),)
    assert cgroup_limit_mb(str(1 << 62)) is None  # cgroup v1's "no limit"


def test_nvidia_smi_counts_gpus_as_a_buddy_size_with_the_smallest_memory() -> None:
    """Three GPUs listed lend two (buddy sizes 1, 2, 4, 8), each with the smallest's memory."""
    assert parse_nvidia_smi("81920\n81559\n81920\n") == (2, 81559)
    assert parse_nvidia_smi("") == (0, 0)


def test_flags_narrow_the_cores_and_replace_memory() -> None:
    """--cpuset keeps only its cores and --cores the first ones, group by group; --memory-mb
    replaces what was detected; a cap that leaves no core is refused."""
    host = HostCapacity(numa=((0, 1, 2, 3), (4, 5, 6, 7)), memory_mb=30000)
    groups, mem = cpu_capacity("x", host, None, Caps(cpuset=(1, 2, 3, 4, 5), cores=4, memory_mb=4096))
    assert groups == ((1, 2, 3), (4,)) and mem == 4096
    assert narrow(host.numa, None, 2) == ((0, 1),)
    with pytest.raises(ValueError, match="no core"):
        cpu_capacity("x", host, None, Caps(cpuset=(99,)))


def test_a_declared_node_lends_as_declared_and_flags_narrow_it() -> None:
    """A config entry is the operator's declaration: its cores (from core_offset) and memory are
    used whatever the host has; flags narrow it further."""
    host = HostCapacity(numa=((0, 1),), memory_mb=1000)
    declared = CpuNodeConfig(name="n1", cores=4, numa_groups=2, memory_mb=8192, core_offset=4)
    assert cpu_capacity("n1", host, declared, Caps()) == (((4, 5), (6, 7)), 8192)
    assert cpu_capacity("n1", host, declared, Caps(cores=3)) == (((4, 5), (6,)), 8192)


def test_gpu_capacity_flags_then_config_then_nvidia_smi_then_default() -> None:
    """A GPU node lends what flags say, else its entry, else what nvidia-smi lists, else one GPU
    of the default memory (CPU-kind Triton); a count that is no buddy size is refused."""
    bare, smi = HostCapacity((), 0), HostCapacity((), 0, num_gpus=4, gpu_memory_mb=40000)
    declared = GpuNodeConfig(name="g", num_gpus=2, gpu_memory_mb=2048)
    assert gpu_capacity("g", bare, None, Caps(), 16384) == (1, 16384)
    assert gpu_capacity("g", smi, None, Caps(), 16384) == (4, 40000)
    assert gpu_capacity("g", smi, declared, Caps(), 16384) == (2, 2048)
    assert gpu_capacity("g", smi, declared, Caps(gpus=1, gpu_memory_mb=999), 16384) == (1, 999)
    with pytest.raises(ValueError, match="1, 2, 4 or 8"):
        gpu_capacity("g", bare, None, Caps(gpus=3), 16384)


def test_cores_no_numa_node_lists_form_a_group_of_their_own() -> None:
    """Cores outside every listed NUMA node are not dropped."""
    assert group_by_numa([0, 1, 9], {0: "0-3"}) == ((0, 1), (9,))


def test_node_name_is_the_flag_else_the_environment_else_the_host_name() -> None:
    """--node wins, then $TANGRAM_NODE, then the host name, made a valid node name."""
    assert node_name("n7", {"TANGRAM_NODE": "e"}, "h") == "n7"
    assert node_name(None, {"TANGRAM_NODE": "edge-3"}, "h") == "edge-3"
    assert node_name(None, {}, "Worker_A.Example:1") == "worker_a.example-1"


def test_an_undeclared_node_is_declared_in_the_workers_own_config() -> None:
    """A worker of a node the config does not declare gets a config in which it is (its own
    settings read it) and a record of what it lends; a declared one keeps its entry as written."""
    cfg = parse_config(
        {
            "nodes": {
                "cpu": [{"name": "n0", "cores": 2, "memory_mb": 1024, "core_offset": 2}],
                "gpu": [{"name": "g0", "num_gpus": 2, "gpu_memory_mb": 2048}],
            },
            "reward_models": [{"name": "rm", "backend": "hf-seq-cls", "path": "/m", "memory_mb": 900}],
        }
    )
    host = HostCapacity(numa=((0, 1, 2),), memory_mb=3000)
    local, rec = resolve_cpu(cfg, "new", Caps(cores=2), host)
    assert [n.name for n in local.nodes.cpu] == ["n0", "new"] and not rec.declared
    assert rec.numa == ((0, 1),) and rec.memory_mb == 3000 and rec.kind == "cpu"
    local, rec = resolve_cpu(cfg, "n0", Caps(), host)
    assert local.nodes.cpu == cfg.nodes.cpu and rec.declared and rec.numa == ((2, 3),)
    local, rec = resolve_gpu(cfg, "g9", Caps(), host)
    assert rec.num_gpus == 1 and rec.gpu_memory_mb == 16384 and len(local.nodes.gpu) == 2
