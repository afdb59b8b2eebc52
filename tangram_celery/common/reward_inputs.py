"""The input schema of each reward backend kind: what a request's `inputs` must hold.

Part of the floor: the clients check a reward action's inputs at submit (`admission`) and the
reward service checks them again before a batch, both from this one table. Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# backend kind -> (module, required string inputs, optional string inputs)
SCHEMAS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "hf-seq-cls": ("hf_seq_cls", ("response",), ("prompt",)),
    "embedding-sim": ("embedding_sim", ("reference", "response"), ()),
    "teacher-logprobs": ("teacher_logprobs", ("prompt", "response"), ()),
    "rule": ("rules", ("response", "reference"), ()),
}

MAX_INPUT_CHARS = 1 << 20


def input_errors(kind: str, inputs: Mapping[str, Any]) -> list[str]:
    """Problems with one request's `inputs` for a backend of `kind` (empty when valid)."""
    if kind not in SCHEMAS:
        return [f"unknown backend kind {kind!r}; known: {sorted(SCHEMAS)}"]
    if not isinstance(inputs, Mapping):
        return [f"inputs must be a mapping, got {type(inputs).__name__}"]
    _, required, optional = SCHEMAS[kind]
    errors = [f"missing input {k!r}" for k in required if k not in inputs]
    for key, value in inputs.items():
        if key not in required and key not in optional:
            errors.append(f"unexpected input {key!r}; {kind} takes {[*required, *optional]}")
        elif not isinstance(value, str):
            errors.append(f"input {key!r} must be a string, got {type(value).__name__}")
        elif len(value) > MAX_INPUT_CHARS:
            errors.append(f"input {key!r} is longer than {MAX_INPUT_CHARS} characters")
    return errors
