"""What both clients do before they talk to Redis: check a batch of actions against the
deployment's pools and turn it into the store's submit items. No I/O: `TangramClient` and
`AsyncTangramClient` read the pools and languages (`wants_view`, `wants_languages`) and send
the batch, each on its own connection.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tangram_celery.common.actions import ActionStatus, CodeAction, new_id
from tangram_celery.common.admission import LANGUAGES_TTL_S, AnyAction, admit, coerce_action, limits_from_view
from tangram_celery.common.config import TangramConfig
from tangram_celery.common.errors import ActionRejected, TangramError
from tangram_celery.common.wire import ActionResult, PoolView
from tangram_celery.store.client_ops import Item


@dataclass(frozen=True)
class Batch:
    """A checked batch, ready for `Store.submit` / `AsyncStore.submit`."""

    items: list[Item]
    trajectories: list[str]  # of each item ("" for none)
    max_queued: int  # the intake bound (0: none published yet)
    admit_memory_fraction: float
    queued_ttl_s: float


class ClientCore:
    """The pools a client checks actions against: from its config, else as the scheduler
    published them (asked for again until one has; the scheduler checks at intake), with the
    languages the CPU workers reported (re-read every LANGUAGES_TTL_S)."""

    def __init__(self, config: TangramConfig | None) -> None:
        self.config = config
        self.view: PoolView | None = PoolView.of(config) if config else None
        # no CPU node declared (nodes join at run time): follow the scheduler's published
        # view, which grows and shrinks with the nodes, re-read every LANGUAGES_TTL_S
        self.follow = self.view is None or (config is not None and not config.nodes.cpu)
        if self.follow:
            self.view = None
        self._view_read_s = float("-inf")
        self.langs: dict[str, list[str]] = {}  # CPU node -> languages, as its worker reported
        self._langs_read_s = float("-inf")
        self._checked: tuple[PoolView, dict[str, list[str]], PoolView] | None = None
        self.images: dict[str, set[str]] = {}  # CPU node -> images it holds or can fetch

    def wants_view(self, now_s: float) -> bool:
        """Whether to read the published pools (`client_ops.pool_view`) and `saw_view` them at
        monotonic `now_s`: until one is published, then again every LANGUAGES_TTL_S when the
        config declares no CPU node (they join at run time)."""
        if self.view is None:
            return True
        return self.follow and now_s - self._view_read_s > LANGUAGES_TTL_S

    def saw_view(self, view: PoolView | None, now_s: float) -> None:
        self.view, self._view_read_s = view, now_s

    def wants_languages(self, now_s: float) -> bool:
        """Whether to read the languages (`client_ops.languages`) at monotonic `now_s`."""
        return now_s - self._langs_read_s > LANGUAGES_TTL_S

    def saw_languages(self, langs: dict[str, list[str]], now_s: float) -> None:
        self.langs, self._langs_read_s = langs, now_s

    def saw_images(self, images: dict[str, set[str]]) -> None:
        """CPU node -> the images it holds or can fetch (read with the languages)."""
        self.images = images

    def check_image(self, action: AnyAction) -> None:
        """ActionRejected for a code action whose image no CPU node reported (none reported
        yet: the worker refuses it then)."""
        image = getattr(action, "image", None)
        if image and self.images and not any(image in refs for refs in self.images.values()):
            raise ActionRejected(
                f"image {image!r} is not on any CPU node and no node's image sources have it "
                f"(checked: {', '.join(sorted(self.images))}); build or load it on the nodes, or "
                "list its OCI layout in sandbox.images.oci_dirs"
            )

    def checked_view(self) -> PoolView | None:
        """The pool view with the reported languages (rebuilt only when either changes)."""
        if self.view is None:
            return None
        cached = self._checked
        if cached is None or cached[0] is not self.view or cached[1] is not self.langs:
            cached = self._checked = (self.view, self.langs, self.view.with_languages(self.langs))
        return cached[2]

    def batch(self, actions: Iterable[AnyAction | dict[str, Any]], now_s: float) -> Batch:
        """Validate every action (wall-clock `now_s`: their submit time); ActionRejected for
        the first invalid one or an id given twice, before anything is enqueued."""
        view = self.checked_view()
        limits = self.config.limits if self.config else limits_from_view(view)
        items: list[Item] = []
        trajectories: list[str] = []
        seen: set[str] = set()
        for raw in actions:
            action = coerce_action(raw)
            if action.id in seen:
                raise ActionRejected(f"action id {action.id!r} appears twice in one submit")
            seen.add(action.id)
            self.check_image(action)
            items.append(admit(action, view, limits, now_s))
            trajectories.append(action.trajectory_id or "")
        return Batch(
            items,
            trajectories,
            max_queued=view.max_queued if view else 0,
            admit_memory_fraction=view.admit_memory_fraction if view else 0.8,
            queued_ttl_s=limits.queued_ttl_s,
        )


MAX_FORKS = 256


def fork_action(trajectory_id: str, n: int = 0, ids: list[str] | None = None) -> tuple[CodeAction, list[str]]:
    """The action that forks `trajectory_id` into `ids` (or `n` new ids), and those ids: a
    no-op in the trajectory's sandbox, ordered after its earlier actions, after which each new
    trajectory starts from a copy of its files on its node (`CodeAction.fork_to`)."""
    new = list(ids) if ids else [f"{trajectory_id[:96]}.f{i}-{new_id()[:8]}" for i in range(n)]
    if not 1 <= len(new) <= MAX_FORKS:
        raise ActionRejected(f"a fork makes 1 to {MAX_FORKS} trajectories, not {len(new)}")
    try:
        action = CodeAction(trajectory_id=trajectory_id, language="bash", code="true", fork_to=new)
    except ValueError as e:
        raise ActionRejected(f"cannot fork {trajectory_id!r}: {e}") from None
    return action, new


def forked(trajectory_id: str, new: list[str], result: ActionResult) -> list[str]:
    """The new ids once the fork's action succeeded; TangramError saying why otherwise."""
    if result.status is not ActionStatus.OK:
        why = result.detail or result.error or result.stderr
        raise TangramError(f"fork of {trajectory_id!r} failed ({result.status.value}): {why}")
    return new
