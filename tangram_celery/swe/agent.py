"""A scripted SWE-style trajectory: what an agent does in its task's image, as Tangram code actions.

Each step is one `bash` action in the trajectory's image (`CodeAction.image`), so it sees the
repository at /repo, and what one step writes the next one sees:

1. inspect: list the repository and grep for the function the issue is about;
2. reproduce: run the project's tests of that area (they fail);
3. edit: write the fix (a Python edit of the source file, run from bash);
4. verify: run the same tests again (they pass);
5. reward: a `grade` action. The trajectory's source changes (not its test files, conftest.py,
   pytest.ini and the like) are copied into a fresh sandbox of the image, the hidden tests are
   written there pristine (`files`), and `test_command` runs under the harness, which rewrites
   pytest to its own reporter and passes the suite only on that report (reward 1 or 0).

Cheating variants replace the edit: `edit-tests` rewrites the test modules so that every assert
holds, `skip-conftest` plants a conftest.py that skips every test, and `forge-conftest` plants one
that turns every failed report into a pass. Each "works" in the trajectory's own sandbox (its
verify step passes, or skips); their reward must be 0, since grading leaves test infrastructure
out and a skip is not a pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tangram_celery.common.actions import ActionStatus, CodeAction, TestOutcome
from tangram_celery.swe.tasks import Edit, SweTask

CHEATS = ("edit-tests", "skip-conftest", "forge-conftest")
KINDS = ("fix", "no-fix", *CHEATS)  # "no-fix": an agent that submits without changing anything
STEP_TIMEOUT_S = 60.0
REWARD_TIMEOUT_S = 120.0

SKIP_CONFTEST = """\
import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.skip(reason="nothing to see"))
"""

FORGE_CONFTEST = """\
import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
    report.longrepr = None
"""


def edit_command(edit: Edit) -> str:
    """A bash command that makes `edit` in the repository (exit 1 if the text is not there once)."""
    return (
        "python3 - <<'EOF'\n"
        "import pathlib, sys\n"
        f"p = pathlib.Path({edit.path!r})\n"
        "s = p.read_text()\n"
        f"old, new = {edit.old!r}, {edit.new!r}\n"
        "if s.count(old) != 1:\n"
        "    sys.exit(f'{p}: the text to replace occurs {s.count(old)} times')\n"
        "p.write_text(s.replace(old, new))\n"
        "print(f'edited {p}')\n"
        "EOF\n"
    )


def _write_file(path: str, text: str) -> str:
    return f"cat > {path} <<'EOF'\n{text}EOF\necho planted {path}\n"


def edit_step(t: SweTask, kind: str) -> str:
    """The bash command of the edit step of a trajectory of `kind` (one of KINDS)."""
    if kind == "fix":
        return edit_command(t.fix)
    if kind == "no-fix":
        return "echo 'no change: submitting as it is'\n"
    if kind == "edit-tests":
        files = " ".join(t.test_files)
        return f"sed -i -E 's/^( *)assert /\\1assert True or /; s/self\\.assert[A-Za-z]*\\(/(lambda *a, **k: None)(/' {files}\n"
    if kind == "skip-conftest":
        return _write_file("conftest.py", SKIP_CONFTEST)
    if kind == "forge-conftest":
        return _write_file("conftest.py", FORGE_CONFTEST)
    raise ValueError(f"unknown trajectory kind {kind!r}; known: {', '.join(KINDS)}")


@dataclass(frozen=True)
class Step:
    name: str
    action: CodeAction


def steps(t: SweTask, tid: str, hidden: dict[str, str], kind: str = "fix") -> list[Step]:
    """The trajectory `tid`'s actions for task `t`, in order; `hidden`: the pristine test files."""

    def bash(code: str, timeout_s: float = STEP_TIMEOUT_S) -> CodeAction:
        return CodeAction(language="bash", image=t.image, trajectory_id=tid, code=code, timeout_s=timeout_s)

    tests = "python3 -m pytest -q -p no:cacheprovider " + " ".join(t.test_files)
    edit = edit_step(t, kind)
    reward = CodeAction(
        language="bash",
        image=t.image,
        trajectory_id=tid,
        files=hidden,
        test_command=t.test_command,
        timeout_s=REWARD_TIMEOUT_S,
        grade=True,
    )
    return [
        Step("inspect", bash(f"pwd; ls; grep -rn --include='*.py' 'def {t.function}\\b' . | head -5")),
        Step("reproduce", bash(f"{tests} 2>&1 | tail -n 15; exit ${{PIPESTATUS[0]}}")),
        Step("edit", bash(edit)),
        Step("verify", bash(f"{tests} 2>&1 | tail -n 15; exit ${{PIPESTATUS[0]}}")),
        Step("reward", reward),
    ]


class Result(Protocol):
    """What a step returns: a client's `ActionResult` or a sandbox's `ExecResult`."""

    @property
    def status(self) -> ActionStatus: ...
    @property
    def exit_code(self) -> int | None: ...
    @property
    def stdout(self) -> str: ...
    @property
    def tests(self) -> list[TestOutcome]: ...


@dataclass
class Outcome:
    """A finished trajectory: its task, its results per step, and its reward (1.0 or 0.0)."""

    task: str
    tid: str
    kind: str
    results: dict[str, Any]  # step name -> Result

    @property
    def expected_reward(self) -> float:
        """Only a trajectory that fixed the bug deserves the reward."""
        return 1.0 if self.kind == "fix" else 0.0

    @property
    def reward(self) -> float:
        """1.0 when the reward action's suite passed: status OK, and every test it ran passed."""
        res = self.results.get("reward")
        ok = (
            res is not None
            and res.status is ActionStatus.OK
            and res.tests
            and all(x.passed for x in res.tests)
        )
        return 1.0 if ok else 0.0


def run_trajectory(
    run: Callable[[CodeAction], Result],
    t: SweTask,
    tid: str,
    hidden: dict[str, str],
    kind: str = "fix",
) -> Outcome:
    """Run the trajectory's steps one after the other through `run` (one action -> its result,
    e.g. `lambda a: client.submit(a).result(timeout=600)`); every step runs, whatever the one
    before returned, as an agent that reads its outputs would go on."""
    out = Outcome(t.name, tid, kind, {})
    for step in steps(t, tid, hidden, kind):
        out.results[step.name] = run(step.action)
    return out
