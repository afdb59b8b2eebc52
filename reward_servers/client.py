"""Send a list of requests to one Triton replica as batches, get one result per request back.

Rows travel as JSON documents in a TYPE_STRING tensor of shape [n, 1]. A list longer than the
model's `max_batch` is cut into pieces; with `parallel > 1` (a replica with DoP instances) it is
also cut into at least `parallel` pieces sent concurrently, so every instance gets a share.
"""

from __future__ import annotations

import json
from typing import Any

from reward_servers.backends.deps import require
from reward_servers.errors import InferenceFailed, TritonCrashed
from reward_servers.triton import TritonController, _is_connection_error


def pieces(n: int, max_batch: int, parallel: int = 1) -> list[tuple[int, int]]:
    """[start, end) ranges covering n rows, each <= max_batch, at least min(parallel, n) of them, near equal."""
    if n <= 0:
        return []
    count = max(-(-n // max_batch), min(parallel, n))
    base, extra = divmod(n, count)
    out, at = [], 0
    for i in range(count):
        size = base + (1 if i < extra else 0)
        out.append((at, at + size))
        at += size
    return out


def _encode(rows: list[dict[str, Any]]) -> Any:
    np = require("numpy")
    http = require("tritonclient.http")
    arr = np.array([[json.dumps(r).encode()] for r in rows], dtype=np.object_)
    tensor = http.InferInput("REQUEST", list(arr.shape), "BYTES")
    tensor.set_data_from_numpy(arr)
    return tensor


def _decode(result: Any) -> list[dict[str, Any]]:
    return [json.loads(x) for x in result.as_numpy("RESULT").reshape(-1)]


def infer(
    controller: TritonController,
    name: str,
    rows: list[dict[str, Any]],
    *,
    max_batch: int,
    parallel: int = 1,
) -> list[dict[str, Any]]:
    """Score `rows` on Triton model `name`; results in the same order.

    Raises TritonCrashed when the server is unreachable, InferenceFailed when the backend errs.
    """
    ranges = pieces(len(rows), max_batch, parallel)
    if not ranges:
        return []
    try:
        if len(ranges) == 1:
            return _decode(controller.client().infer(name, [_encode(rows)], headers=controller.headers))
        client = controller.client(concurrency=max(1, min(parallel, len(ranges))))
        handles = [
            client.async_infer(name, [_encode(rows[a:b])], headers=controller.headers) for a, b in ranges
        ]
        out: list[dict[str, Any]] = []
        for h in handles:
            out.extend(_decode(h.get_result()))
        return out
    except Exception as e:
        if _is_connection_error(e):
            raise TritonCrashed(f"tritonserver at {controller.url} unreachable: {e}") from None
        raise InferenceFailed(f"{name}: {e}") from None
