"""Shared fixtures; every test's tier (unit or integration) comes from its directory."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = [
    "tests.fixtures.redis",
    "tests.fixtures.docker",
    "tests.fixtures.triton",
    "tests.fixtures.netns",
    "tests.fixtures.browser",
    "tests.fixtures.sandbox",
    "tests.fixtures.images",
    "tests.fixtures.tls",
]


# A test's tier is its directory: tests/unit (pure, no servers) or tests/integration (real Redis,
# Docker, Triton, Celery workers). `make test-unit` and `make test-integration` select by these
# markers, so a test anywhere else, or one marked for the other tier by hand, would be run by
# neither: collection fails instead.
TIERS = ("unit", "integration")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(__file__).resolve().parent
    untiered = []
    for item in items:
        rel = Path(str(item.path)).resolve().relative_to(root)
        tier = rel.parts[0] if len(rel.parts) > 1 else ""
        marked = {m.name for m in item.iter_markers() if m.name in TIERS}
        if tier not in TIERS or marked - {tier}:
            untiered.append(f"{item.nodeid} (directory {tier or '.'}, marked {sorted(marked)})")
            continue
        item.add_marker(getattr(pytest.mark, tier))
    if untiered:
        raise pytest.UsageError(
            "every test lives in tests/unit or tests/integration, which gives its tier; these do not:\n  "
            + "\n  ".join(untiered)
        )
