"""Helpers for the HTTP API tests: the real third-party clients, loaded without their frameworks."""

from __future__ import annotations

import http.client
import importlib.util
import json
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import pytest


def http_call(
    url: str, method: str, path: str, headers: dict[str, str] | None = None, body: Any = None
) -> tuple[int, dict[str, Any], dict[str, str]]:
    """One request to the server at `url`, JSON in and out: (status, body, headers lower-cased)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=60)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        raw = r.read()
        return r.status, json.loads(raw) if raw else {}, {k.lower(): v for k, v in r.getheaders()}
    finally:
        conn.close()


def bearer_call(
    url: str, method: str, path: str, token: str, body: Any = None, **headers: str
) -> tuple[int, Any]:
    """(status, body) of one request made with `token` as its bearer token."""
    status, answer, _ = http_call(url, method, path, {"Authorization": f"Bearer {token}", **headers}, body)
    return status, answer


def verl_sandbox_utils() -> ModuleType:
    """verl's own SandboxFusion client (`verl/utils/reward_score/sandbox_fusion/utils.py`),
    loaded by file path: importing the `verl` package pulls torch and ray."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("verl is not installed (make venv installs it without dependencies)")
    path = Path(spec.submodule_search_locations[0]) / "utils/reward_score/sandbox_fusion/utils.py"
    name = "verl_sandbox_fusion_utils"
    if name in sys.modules:
        return sys.modules[name]
    mod_spec = importlib.util.spec_from_file_location(name, path)
    assert mod_spec is not None and mod_spec.loader is not None
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def run_log(
    state_dir: Path, wait_for: set[str] | None = None, timeout_s: float = 30.0
) -> dict[str, dict[str, Any]]:
    """The scheduler's run log (<state_dir>/actions.jsonl) by action id; with `wait_for`, wait
    until those ids are in it (the scheduler flushes it every few seconds)."""
    path = state_dir / "actions.jsonl"
    deadline = time.monotonic() + timeout_s
    while True:
        records: dict[str, dict[str, Any]] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    rec = json.loads(line)
                    records[rec["action_id"]] = rec
        if not wait_for or wait_for <= set(records) or time.monotonic() > deadline:
            return records
        time.sleep(0.5)
