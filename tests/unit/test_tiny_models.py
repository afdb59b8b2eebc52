"""Which `build:` reward models a deployment still has to build (no torch needed to decide)."""

from __future__ import annotations

from pathlib import Path

from reward_servers.tiny_models import missing_builds
from tangram_celery.common.config import parse_config


def test_only_models_with_build_and_no_model_at_their_path_are_built(tmp_path: Path) -> None:
    """A `build:` model is built while its path holds no config.json (a half-written directory
    does not count), never again after; models without `build:` are never built."""
    built = tmp_path / "built"
    built.mkdir()
    (built / "config.json").write_text("{}")
    half = tmp_path / "half"
    half.mkdir()
    (half / "tokenizer.json").write_text("{}")
    cfg = parse_config(
        {
            "nodes": {"gpu": [{"name": "g", "num_gpus": 1, "gpu_memory_mb": 1024}]},
            "reward_models": [
                {
                    "name": "a",
                    "backend": "hf-seq-cls",
                    "path": str(tmp_path / "new"),
                    "build": "tiny-seq-cls",
                },
                {"name": "b", "backend": "hf-seq-cls", "path": str(built), "build": "tiny-seq-cls"},
                {"name": "c", "backend": "teacher-logprobs", "path": str(half), "build": "tiny-causal-lm"},
                {"name": "d", "backend": "hf-seq-cls", "path": str(tmp_path / "absent")},
            ],
        }
    )
    assert [m.name for m in missing_builds(cfg)] == ["a", "c"]
