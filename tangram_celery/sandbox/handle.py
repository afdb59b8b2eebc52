"""A trajectory's live sandbox as the pool holds it, and the kept connection to its runner."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tangram_celery.sandbox.cgroups import CgroupSet
from tangram_celery.sandbox.link import RunnerLink


@dataclass
class Handle:
    """One trajectory's live sandbox."""

    trajectory_id: str
    state_dir: Path  # root-only host dir bind-mounted at /run/tangram (holds the runner socket)
    memory_mb: int
    cores: tuple[int, ...]
    ref: Any = None  # backend object: docker Container or bwrap Popen
    cgroups: CgroupSet | None = None
    last_used_s: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)
    gen: str = ""  # the scheduler's generation of this trajectory sandbox ("" when not told)
    used: bool = False  # an action of this occupant reached its runner (its files may matter)
    link: RunnerLink | None = None  # the kept connection to the runner of `ref` (`call`)
    # A container image's sandbox (`image_layers`): the image, the store's copy of it, the
    # trajectory's layer (namespace backend), its workdir; `kept_files`: its files came back
    # from a kept layer; `keep_files`: when it goes, its layer is kept (an eviction, not a close)
    image: str | None = None
    stored: Any = None
    layer: Any = None
    workdir: str = ""
    kept_files: bool = False
    keep_files: bool = False

    @property
    def socket_path(self) -> Path:
        return self.state_dir / "runner.sock"

    def call(self, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """One request to this sandbox's runner over the connection kept for it (made now when
        there is none, or when the one there was made for another sandbox of the handle)."""
        link = self.link
        if link is None or link.owner is not self.ref:
            self.drop_link()
            link = self.link = RunnerLink(self.socket_path, self.ref)
        return link.call(payload, timeout_s)

    def drop_link(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None
