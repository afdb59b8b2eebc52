"""What one action may carry: the deployment's payload caps, checked before anything is enqueued.

The action models validate shape (types, path rules, a hard nesting ceiling); the caps here are
the deployment's own (`limits` in the config, published with the pool view so that a client
without the config file applies the same ones). Sizes are UTF-8 bytes, not characters.
"""

from __future__ import annotations

from typing import Any

from tangram_celery.actions import ApiAction, CodeAction, RewardAction, json_depth
from tangram_celery.config import LimitsConfig


def _b(text: str | None) -> int:
    return 0 if text is None else len(text.encode("utf-8", "surrogatepass"))


def payload_errors(action: CodeAction | RewardAction | ApiAction, limits: LimitsConfig) -> list[str]:
    """Every cap `action` exceeds, each as 'what: size > cap (limits.key)'; [] when it fits."""
    out: list[str] = []

    def cap(what: str, size: int, key: str) -> None:
        limit = int(getattr(limits, key))
        if size > limit:
            out.append(f"{what}: {size} > {limit} (limits.{key})")

    if isinstance(action, CodeAction):
        cap("code bytes", _b(action.code), "max_code_bytes")
        cap("stdin bytes", _b(action.stdin), "max_stdin_bytes")
        cap("files entries", len(action.files) + len(action.binary_files), "max_files")
        files_b = sum(_b(c) for c in action.files.values())
        files_b += sum(len(c) * 3 // 4 for c in action.binary_files.values())  # decoded size
        cap("files bytes", files_b, "max_files_bytes")
        cap("test cases", len(action.test_cases), "max_test_cases")
        for t in action.test_cases:
            for field in ("stdin", "expected_stdout", "assert_code"):
                size = _b(getattr(t, field))
                if size > limits.max_test_field_bytes:
                    cap(f"test {t.name!r} {field} bytes", size, "max_test_field_bytes")
                    break
    elif isinstance(action, RewardAction):
        cap("inputs nesting depth", json_depth(action.inputs), "max_json_depth")
    else:
        cap("request nesting depth", json_depth(action.request), "max_json_depth")
    return out


def limits_from_view(view: dict[str, Any] | None) -> LimitsConfig:
    """The caps a scheduler published (defaults when it published none, e.g. an older one)."""
    raw = (view or {}).get("limits")
    return LimitsConfig.model_validate(raw) if isinstance(raw, dict) else LimitsConfig()
