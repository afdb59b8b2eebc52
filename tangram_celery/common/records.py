"""Records that processes keep in Redis for one another, as versioned models (`wire._Wire`).

- `PinRecord` (`tangram:traj`, trajectory -> record): scheduler -> itself after a restart.
  Where a trajectory is pinned, the memory it holds there, its sandbox's generation and owner
  (`scheduler/service/sandboxes.py`).
- `SandboxReport` (`tangram:sandboxes`, worker -> record): CPU worker -> scheduler. The
  sandboxes a worker incarnation holds, at its completion counter `seq`.
- `WarmStatus` (`tangram:warm`, GPU node -> record): GPU worker -> `tangram up`. How the
  node's warm-up goes.

Each writer dumps the model (`dump`), each reader parses it (`parse`); records written before
these models existed carry no `v` and read as version 1.
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field

from tangram_celery.common.wire import _Wire


class _Record(_Wire):
    def dump(self) -> str:
        """The record as Redis keeps it (JSON, absent fields left out)."""
        return self.model_dump_json(exclude_none=True)

    @classmethod
    def parse(cls, raw: str | bytes) -> Self:
        return cls.model_validate_json(raw)


class PinRecord(_Record):
    """A pinned trajectory: its CPU `node`, the memory reserved there, its sandbox's generation
    `gen` (the pinning action's id) and `owner` (worker incarnation, completion counter)."""

    node: str
    memory_mb: int = Field(0, ge=0)
    gen: str = ""
    owner: tuple[str, int] | None = None


class SandboxReport(_Record):
    """A CPU worker incarnation's sandboxes: (trajectory, generation) each, listed after its
    completion counter read `seq` (a sandbox made by an action counted is listed)."""

    seq: int = 0
    held: tuple[tuple[str, str], ...] = ()

    def generations(self) -> dict[str, str]:
        """Trajectory -> generation of each sandbox held."""
        return dict(self.held)


class WarmStatus(_Record):
    """A GPU node's warm-up: `warming` its `services` since `started_s`, or `done`, with the
    replicas `loaded`, the ones that `failed` (replica -> why) and the `seconds` it took."""

    state: Literal["warming", "done"]
    services: tuple[str, ...] = ()
    started_s: float = 0.0
    loaded: tuple[str, ...] = ()
    failed: dict[str, str] = Field(default_factory=dict)
    seconds: float = 0.0
