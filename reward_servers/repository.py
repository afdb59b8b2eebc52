"""Generate a Triton model repository from the reward-model config.

One Triton model per *replica*: every (reward model, DoP) pair is a service, and every aligned
buddy chunk of DoP GPUs on the node can hold one replica of it (`<model>__dop<D>__g<start>`).
All of them are written at deploy time (the paper deploys every service on every feasible GPU
group); the replica manager loads and unloads them on demand in explicit model-control mode.

On a node with GPUs the replica's `instance_group` is KIND_GPU pinned to the chunk's devices
(one instance per GPU of the chunk); without GPUs the same replica gets DoP KIND_CPU instances.
Rule-based models are not written: they run as CPU actions.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from reward_servers.control import control_dir, record
from reward_servers.control import record_path as control_record
from reward_servers.naming import aligned_chunks, replica_name
from tangram_celery.common.config import GpuNodeConfig, RewardModelConfig

MODEL_TEMPLATE = Path(__file__).with_name("triton_model.py")
SRC_ROOT = Path(__file__).resolve().parent.parent  # put on the stub's sys.path


@dataclass(frozen=True)
class ReplicaSpec:
    """One generated Triton model: a service on one chunk."""

    name: str
    model: str
    dop: int
    chunk: tuple[int, ...]
    memory_mb: int  # per GPU of the chunk


def has_gpus() -> bool:
    """True when this host exposes NVIDIA GPUs (device nodes present)."""
    return os.path.exists("/dev/nvidia0") or bool(os.environ.get("TANGRAM_FORCE_GPU"))


def instance_kind(node: GpuNodeConfig) -> str:
    """'KIND_GPU' or 'KIND_CPU' for `node` ('auto' looks for GPUs on this host)."""
    if node.instance_kind == "auto":
        return "KIND_GPU" if has_gpus() else "KIND_CPU"
    return "KIND_GPU" if node.instance_kind == "gpu" else "KIND_CPU"


def replica_specs(models: Iterable[RewardModelConfig], node: GpuNodeConfig) -> list[ReplicaSpec]:
    """Every (model, DoP, chunk) replica that fits `node`; rule models are skipped."""
    out = []
    for m in models:
        if m.backend == "rule":
            continue
        for dop in m.dop_options:
            for chunk in aligned_chunks(node.num_gpus, dop):
                out.append(ReplicaSpec(replica_name(m.name, dop, chunk), m.name, dop, chunk, m.memory_mb))
    return out


def _pbtxt_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def config_pbtxt(
    model: RewardModelConfig,
    spec: ReplicaSpec,
    kind: str,
    *,
    cpu_threads: int = 1,
    max_seq_len: int = 512,
    control: Path | None = None,
) -> str:
    """The config.pbtxt of one replica (`control`: the directory of its control sockets)."""
    if kind == "KIND_GPU":
        group = f"{{ count: 1 kind: KIND_GPU gpus: [ {', '.join(map(str, spec.chunk))} ] }}"
    else:
        group = f"{{ count: {spec.dop} kind: KIND_CPU }}"
    params = {
        "kind": model.backend,
        "path": str(Path(model.path).resolve()) if model.path else None,
        "package": model.package,
        "rule": model.rule,
        "max_seq_len": max_seq_len,
        "cpu_threads": cpu_threads,
        "src": str(SRC_ROOT),
        "control_dir": str(control) if control is not None else None,
    }
    delay_us = round(model.batch_window_ms * 1000)
    return "\n".join(
        [
            f"name: {_pbtxt_string(spec.name)}",
            'backend: "python"',
            f"max_batch_size: {model.max_batch}",
            'input [ { name: "REQUEST" data_type: TYPE_STRING dims: [ 1 ] } ]',
            'output [ { name: "RESULT" data_type: TYPE_STRING dims: [ 1 ] } ]',
            f"instance_group [ {group} ]",
            f"dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}",
            f'parameters: {{ key: "tangram" value: {{ string_value: {_pbtxt_string(json.dumps(params))} }} }}',
            "",
        ]
    )


def build_repository(
    models: Iterable[RewardModelConfig],
    node: GpuNodeConfig,
    out_dir: str | os.PathLike[str],
    *,
    cpu_threads: int = 1,
    max_seq_len: int = 512,
) -> list[ReplicaSpec]:
    """Write the repository for `node` into `out_dir` (replacing what was there); returns its replicas."""
    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    control_record(out).unlink(missing_ok=True)  # a fresh build decides afresh
    out.mkdir(parents=True)
    kind = instance_kind(node)
    models = list(models)
    by_name = {m.name: m for m in models}
    specs = replica_specs(models, node)
    control = control_dir(out)
    record(out, control)
    for spec in specs:
        d = out / spec.name
        (d / "1").mkdir(parents=True)
        text = config_pbtxt(
            by_name[spec.model], spec, kind, cpu_threads=cpu_threads, max_seq_len=max_seq_len, control=control
        )
        (d / "config.pbtxt").write_text(text)
        shutil.copyfile(MODEL_TEMPLATE, d / "1" / "model.py")
    return specs
