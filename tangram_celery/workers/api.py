"""API worker: calls a rate-limited external API; the scheduler enforces the pool's limits, and
each tenant's share of them (`api_share`, `scheduler.tenancy`), before it sends a call here."""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from tangram_celery.common.actions import ActionStatus, ApiAction, stored_action
from tangram_celery.common.config import ApiConfig
from tangram_celery.common.wire import ActionResult, TaskOrder

_pool = cf.ThreadPoolExecutor(max_workers=64, thread_name_prefix="api-call")


def load_callable(spec: str) -> Callable[[dict[str, Any]], Any]:
    """'package.module:function' -> the function."""
    mod, _, fn = spec.partition(":")
    try:
        fn_obj: Callable[[dict[str, Any]], Any] = getattr(importlib.import_module(mod), fn)
        return fn_obj
    except (ImportError, AttributeError) as e:
        raise ValueError(f"API handler {spec!r} cannot be loaded: {e}") from e


class ApiHandler:
    """Serves one configured API: a Python callable or an HTTP POST of the request as JSON."""

    def __init__(self, cfg: ApiConfig) -> None:
        self.cfg = cfg
        self.fn = None if cfg.handler == "http" else load_callable(cfg.handler)
        warmup = getattr(self.fn, "warmup", None)
        if callable(warmup):  # e.g. an index to build: do it now, not on the first call
            _pool.submit(warmup)

    def _http(self, request: dict[str, Any]) -> Any:
        assert self.cfg.base_url
        path = str(request.get("path", ""))
        body = json.dumps(request.get("json", request)).encode()
        req = urllib.request.Request(
            self.cfg.base_url.rstrip("/") + "/" + path.lstrip("/"),
            data=body,
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=self.cfg.timeout_s) as resp:
            return json.loads(resp.read().decode() or "null")

    def __call__(self, action_id: str, payload: dict[str, Any], order: TaskOrder) -> ActionResult:
        action = stored_action(payload)  # checked at submit: typed, not validated again
        if not isinstance(action, ApiAction):
            raise ValueError(f"action {action_id}: a {action.type} action sent to an API worker")
        call = self._http if self.fn is None else self.fn
        timeout_s = min(action.timeout_s, self.cfg.timeout_s)
        fut = _pool.submit(call, action.request)
        try:
            out = fut.result(timeout=timeout_s)
        except cf.TimeoutError:
            return ActionResult(
                action_id=action_id, status=ActionStatus.TIMEOUT, error=f"no answer in {timeout_s}s"
            )
        except (urllib.error.URLError, ValueError, TypeError, KeyError, ArithmeticError) as e:
            return ActionResult(
                action_id=action_id, status=ActionStatus.FAILED, error=f"{type(e).__name__}: {e}"
            )
        return ActionResult(action_id=action_id, status=ActionStatus.OK, output=out)
