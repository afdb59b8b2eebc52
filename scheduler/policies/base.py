"""The policy interface and its registry."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from scheduler.execution import ExecutionModel
from scheduler.model import Allocation, QueuedAction
from scheduler.resources import ClusterState


class Policy(Protocol):
    """decide(queue, state, now_s) -> allocations to start now, in the order to apply them.

    `queue` is the waiting queue in FCFS order. `state` must not be mutated. Every returned
    allocation must be applicable, in order, to `state` with `ClusterState.apply`.
    `execution` says how its decisions run (`scheduler.execution`).
    """

    name: str
    execution: ExecutionModel

    def decide(
        self, queue: Sequence[QueuedAction], state: ClusterState, now_s: float
    ) -> list[Allocation]: ...


_REGISTRY: dict[str, Callable[..., Policy]] = {}


def register(name: str) -> Callable[[Callable[..., Policy]], Callable[..., Policy]]:
    """Class decorator: make a policy selectable by `name` in the config."""

    def deco(factory: Callable[..., Policy]) -> Callable[..., Policy]:
        _REGISTRY[name] = factory
        return factory

    return deco


def available() -> list[str]:
    return sorted(_REGISTRY)


def get_policy(name: str, **params: object) -> Policy:
    """Instantiate the policy registered under `name` (e.g. "fcfs-min", "fixed-dop-4")."""
    if name in _REGISTRY:
        return _REGISTRY[name](**params)
    # Parametrised names such as "fixed-dop-4": the registry holds the prefix.
    head, _, tail = name.rpartition("-")
    if head in _REGISTRY and tail.isdigit():
        return _REGISTRY[head](int(tail), **params)
    raise KeyError(f"unknown policy {name!r}; choose one of: {', '.join(available())}")


def live_policies() -> list[str]:
    """The registered policies whose execution model the live service can run (with their
    default parameters)."""
    return [name for name in available() if not _REGISTRY[name]().execution.live_gaps()]


def live_gaps(name: str, **params: object) -> list[str]:
    """Why the live service cannot run policy `name` ([] when it can); KeyError if unknown."""
    return get_policy(name, **params).execution.live_gaps()
