"""Reward backends, one file per kind, and the input schema each accepts.

Everything here imports only the standard library at module level, so the client can validate
inputs at submit without torch installed; a backend module is imported when a model is loaded.
"""

from __future__ import annotations

import importlib

from reward_servers.backends.base import Backend, BackendParams
from tangram_celery.common.reward_inputs import MAX_INPUT_CHARS, SCHEMAS, input_errors


def load_backend(kind: str, params: BackendParams) -> Backend:
    """Import the module of `kind` and build its backend (loads the model)."""
    module = importlib.import_module(f"reward_servers.backends.{SCHEMAS[kind][0]}")
    backend: Backend = module.make(params)
    return backend


__all__ = ["MAX_INPUT_CHARS", "SCHEMAS", "Backend", "BackendParams", "input_errors", "load_backend"]
