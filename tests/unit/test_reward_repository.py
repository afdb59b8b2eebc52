"""Triton model repository generation and service naming."""

from __future__ import annotations

from pathlib import Path

import pytest

from reward_servers.naming import parse_name, replica_name
from reward_servers.repository import build_repository
from tangram_celery.common.config import GpuNodeConfig, RewardModelConfig

RM = RewardModelConfig(
    name="rm", backend="hf-seq-cls", path="/models/rm", dop_options=(1, 2), max_batch=16, batch_window_ms=2.5
)
RULE = RewardModelConfig(name="exact", backend="rule", rule="exact-match")


def test_every_dop_and_aligned_chunk_is_a_model(tmp_path: Path) -> None:
    """Given dop options 1 and 2 on a 4-GPU node, when built, then 4 + 2 replicas exist and rules are skipped."""
    node = GpuNodeConfig(name="g", num_gpus=4, gpu_memory_mb=8000, instance_kind="cpu")
    specs = build_repository([RM, RULE], node, tmp_path / "repo")
    names = sorted(s.name for s in specs)
    assert names == sorted([f"rm__dop1__g{i}" for i in range(4)] + ["rm__dop2__g0", "rm__dop2__g2"])
    assert (tmp_path / "repo" / "rm__dop2__g2" / "1" / "model.py").exists()


def test_cpu_kind_gets_dop_instances_and_batching(tmp_path: Path) -> None:
    """Given a CPU-kind node, when built, then DoP 2 is two KIND_CPU instances with the batching window."""
    node = GpuNodeConfig(name="g", num_gpus=2, gpu_memory_mb=8000, instance_kind="cpu")
    build_repository([RM], node, tmp_path)
    text = (tmp_path / "rm__dop2__g0" / "config.pbtxt").read_text()
    assert "count: 2 kind: KIND_CPU" in text
    assert "max_batch_size: 16" in text and "max_queue_delay_microseconds: 2500" in text


def test_gpu_kind_pins_the_chunk_devices(tmp_path: Path) -> None:
    """Given a GPU node, when built, then the replica on chunk (2, 3) pins gpus [2, 3]."""
    node = GpuNodeConfig(name="g", num_gpus=4, gpu_memory_mb=8000, instance_kind="gpu")
    build_repository([RM], node, tmp_path)
    text = (tmp_path / "rm__dop2__g2" / "config.pbtxt").read_text()
    assert "kind: KIND_GPU gpus: [ 2, 3 ]" in text


def test_names_round_trip() -> None:
    """Given a replica name, when parsed, then model, DoP and chunk come back."""
    assert parse_name(replica_name("my-rm.v2", 4, (4, 5, 6, 7))) == ("my-rm.v2", 4, (4, 5, 6, 7))
    assert parse_name("rm__dop2") == ("rm", 2, None)
    with pytest.raises(ValueError):
        parse_name("rm")
