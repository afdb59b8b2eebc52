"""CPU worker: runs code actions in the trajectory's sandbox (one-shot actions in a sandbox of
their own) on the cores the scheduler granted, and rule-based reward verifiers (pure functions
of strings, no sandbox needed) in-process."""

from __future__ import annotations

import logging
import threading
from typing import Any

from tangram_celery.common.actions import ActionStatus, CodeAction, RewardAction, stored_action
from tangram_celery.common.config import SandboxConfig
from tangram_celery.common.wire import ActionResult, CoreLoan, SandboxOrder, TaskOrder, wire_trajectory
from tangram_celery.sandbox import ExecRequest, ExecResult, Sandbox
from tangram_celery.workers.loans import CoreLoans

log = logging.getLogger("tangram.worker")


class CpuHandler:
    """Turns a CodeAction + allocation into a sandbox exec and its result into an ActionResult."""

    def __init__(self, sandbox: Sandbox, cfg: SandboxConfig, rules: dict[str, str] | None = None) -> None:
        self.sandbox = sandbox
        self.cfg = cfg
        self.rules = dict(rules or {})  # rule reward model name -> rule
        from tangram_celery.sandbox.languages import available

        # the toolchains this node's sandboxes have, narrowed by sandbox.languages
        self.languages = available(cfg.languages)
        self.loans = CoreLoans()  # cores lent to running malleable actions (`lend`)
        self._resizing = threading.Lock()

    def __call__(self, action_id: str, payload: dict[str, Any], order: TaskOrder) -> ActionResult:
        # its cores are its own from now on: taken back from any borrower before it runs
        cores, changed = self.loans.start(action_id, order.unit_ids)
        self._resize(changed)
        try:
            return self._run(action_id, payload, order, cores)
        finally:
            self.loans.end(action_id)

    def lend(self, loan: CoreLoan) -> None:
        """Carry out the scheduler's loan: resize the borrower (and any action a lent core is
        taken from) to its cores now (`tangram_celery.workers.loans`)."""
        changed = self.loans.lend(loan)
        log.debug("loan %s: %s lent to %s; resizing %s", loan.seq, loan.cores, loan.action_id, changed)
        self._resize(changed)

    def _resize(self, action_ids: list[str]) -> None:
        with self._resizing:  # one at a time: each applies the latest cores of its action
            for aid in action_ids:
                cores = self.loans.cores(aid)
                if cores is not None:
                    self.sandbox.resize(aid, cores)

    def _run(
        self, action_id: str, payload: dict[str, Any], order: TaskOrder, cores: tuple[int, ...]
    ) -> ActionResult:
        action = stored_action(payload)  # checked at submit: typed, not validated again
        if isinstance(action, RewardAction):
            return self._verify(action_id, action)
        if not isinstance(action, CodeAction):
            raise ValueError(f"action {action_id}: a {action.type} action sent to a CPU worker")
        if action.language not in self.languages:  # a client that did not know (no report yet)
            return ActionResult(
                action_id=action_id,
                trajectory_id=wire_trajectory(action.trajectory_id),
                status=ActionStatus.REJECTED,
                error=language_refusal(action.language, self.languages),
            )
        if not order.unit_ids:  # the live service executes only models that name cores
            raise ValueError(f"action {action_id}: its allocation names no cores")
        # The scheduler's word on the trajectory's sandbox (scheduler/service/sandboxes.py):
        # its generation, whether this action starts it, whether the caller lost the last one.
        sandbox = order.sandbox or SandboxOrder()
        req = ExecRequest.of(action, order, cores, self.cfg.verifier_scope)
        if action.grade and action.trajectory_id is not None:  # a fresh sandbox of its files
            res = self.sandbox.grade(action.trajectory_id, req)
        elif action.one_shot or action.trajectory_id is None:
            res = self.sandbox.run_once(req)
        else:
            res = self.sandbox.run(action.trajectory_id, req)
            if action.fork_to and res.status is ActionStatus.OK:
                res = self._fork(action.trajectory_id, action.fork_to, res)
        return ActionResult(
            action_id=action_id,
            status=res.status,
            exit_code=res.exit_code,
            stdout=res.stdout,
            stderr=res.stderr,
            tests=res.tests,
            compile=res.compile,
            exec_s=res.exec_s,
            files=res.files,
            # files kept in an image's layer through an eviction are not a reset
            sandbox_reset=res.sandbox_reset or (sandbox.reset and not res.kept_files),
            cpu_s=res.cpu_s,
            detail=_with_reset_why(
                res.detail, sandbox, res.sandbox_reset or (sandbox.reset and not res.kept_files)
            ),
            # an infrastructure failure says what failed (the runner lost, a runner error)
            error=res.detail if res.status is ActionStatus.ERROR else "",
        )

    def _verify(self, action_id: str, action: RewardAction) -> ActionResult:
        from reward_servers.backends.rules import verify

        rule = self.rules.get(action.model)
        if rule is None:
            return ActionResult(
                action_id=action_id,
                status=ActionStatus.REJECTED,
                error=f"{action.model!r} is not a rule reward model here ({sorted(self.rules)})",
            )
        return ActionResult(
            action_id=action_id, status=ActionStatus.OK, output=verify(rule, dict(action.inputs))
        )

    def _fork(self, tid: str, new_ids: list[str], res: ExecResult) -> ExecResult:
        """After `tid`'s action: each of `new_ids` starts from a copy of its files here."""
        from tangram_celery.common.errors import SandboxError

        try:
            size = self.sandbox.fork(tid, list(new_ids))
        except SandboxError as e:
            res.status, res.detail = ActionStatus.FAILED, f"fork not made: {e}"
            return res
        res.detail = "; ".join(filter(None, [res.detail, f"forked to {len(new_ids)} ({size >> 10} KiB)"]))
        return res

    def close_trajectory(
        self, trajectory_id: str, generation: str | None = None, keep_files: bool = False
    ) -> None:
        self.sandbox.close_trajectory(trajectory_id, generation, keep_files)

    def evict_trajectory(self, trajectory_id: str, generation: str | None = None) -> None:
        """Evicted for memory: the sandbox goes, an image's files stay for the next action."""
        self.sandbox.close_trajectory(trajectory_id, generation, keep_files=True)

    def prefetch(self, image: str) -> None:
        """The scheduler's fetch-ahead order: bring `image` into this node's store in the
        background (a queued new trajectory will run in it here)."""
        threading.Thread(target=self._prefetch, args=(image,), name="image-fetch", daemon=True).start()

    def _prefetch(self, image: str) -> None:
        prefetch = getattr(self.sandbox, "prefetch", None)
        if prefetch is None:
            return
        try:
            prefetch(image)
        except Exception as e:  # the action that needs it will fetch it itself, and say why not
            log.warning("fetch of image %s ahead failed: %s", image, e)

    def images_report(self) -> dict[str, Any] | None:
        """What this node's image store holds and can fetch, and the layers it keeps."""
        report = getattr(self.sandbox, "images_report", None)
        return report() if report is not None else None

    def held(self) -> list[tuple[str, str]]:
        """The trajectory sandboxes this worker holds, for its report to the scheduler."""
        return self.sandbox.held()


def _with_reset_why(detail: str, sandbox: SandboxOrder, reset: bool) -> str:
    """The result's detail, with why the sandbox was reset when the scheduler said (a drained node)."""
    if not reset or not sandbox.why:
        return detail
    return "; ".join(filter(None, [detail, f"sandbox reset: {sandbox.why}"]))


def language_refusal(language: str, available: list[str]) -> str:
    """Why an action in `language` cannot run on a node whose sandboxes run `available`."""
    from tangram_celery.sandbox.languages import missing_hint

    return (
        f"language {language!r} is not available on this CPU node (available: "
        f"{', '.join(available) or 'none'}; {missing_hint(language)}, or allow it in sandbox.languages)"
    )
