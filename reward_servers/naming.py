"""Names of services and replicas.

A *service* is one (reward model, DoP) pair: every DoP configuration is its own service, as in the
paper's GPU manager. A *replica* is a service placed on one aligned buddy chunk of GPUs; each
replica is its own Triton model, so a hot service can be resident on several chunks at once.
"""

from __future__ import annotations

import re

_REPLICA = re.compile(r"^(?P<model>[a-z0-9][a-z0-9_.-]*?)__dop(?P<dop>\d+)(?:__g(?P<start>\d+))?$")


def service_name(model: str, dop: int) -> str:
    """The service of `model` at `dop` GPUs, e.g. 'rm__dop2'."""
    return f"{model}__dop{dop}"


def replica_name(model: str, dop: int, chunk: tuple[int, ...]) -> str:
    """The Triton model name of `model` at `dop` on `chunk`, e.g. 'rm__dop2__g2' (chunk starts at GPU 2)."""
    if len(chunk) != dop:
        raise ValueError(f"chunk {chunk} does not have {dop} GPUs")
    return f"{service_name(model, dop)}__g{chunk[0]}"


def parse_name(name: str) -> tuple[str, int, tuple[int, ...] | None]:
    """(model, dop, chunk or None) from a service or replica name; ValueError if it is neither."""
    m = _REPLICA.match(name)
    if not m:
        raise ValueError(f"{name!r} is not a '<model>__dop<N>[__g<start>]' name")
    dop = int(m.group("dop"))
    start = m.group("start")
    chunk = None if start is None else tuple(range(int(start), int(start) + dop))
    return m.group("model"), dop, chunk


def aligned_chunks(num_gpus: int, size: int) -> list[tuple[int, ...]]:
    """Every buddy chunk of `size` GPUs on a node of `num_gpus` GPUs (aligned to `size`)."""
    return [tuple(range(s, s + size)) for s in range(0, num_gpus - size + 1, size)]
