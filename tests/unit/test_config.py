"""Config loading and validation."""

from pathlib import Path

import pytest

from tangram_celery.config import default_config_path, load_config, parse_config
from tangram_celery.errors import ConfigError

pytestmark = pytest.mark.unit


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
