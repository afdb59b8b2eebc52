"""The SWE-style tasks: a pinned PyPI project (its sdist ships its test suite), one injected bug
and the project's own tests that catch it.

A bug is made SWE-smith style: one precise source edit turns a correct function into a subtly
wrong one (`bug`); the fix is that edit reversed. The hidden tests are the project's own tests
(pytest node ids) that fail with the bug and pass without it, checked for real by
tests/integration/test_swe_images.py. Their files are not in the image as the trajectory sees
them: the reward action sends the pristine copies from the sdist (`CodeAction.files`), so a
trajectory that edited them gains nothing.

Every test here runs with Debian bookworm's `python3` and `python3-pytest` and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Edit:
    """Replace `old` (which occurs exactly once) by `new` in the file `path` of the repository."""

    path: str
    old: str
    new: str

    def apply(self, text: str) -> str:
        """`text` with the edit made; ValueError when `old` does not occur exactly once."""
        n = text.count(self.old)
        if n != 1:
            raise ValueError(f"{self.path}: the text to replace occurs {n} times (need exactly 1)")
        return text.replace(self.old, self.new)

    def reversed(self) -> Edit:
        return Edit(self.path, self.new, self.old)


@dataclass(frozen=True)
class SweTask:
    """One task: the repository at /repo of its image is the sdist with `bug` applied."""

    name: str  # also the image name: tangram-swe/<name>:bug
    project: str  # PyPI name
    version: str  # pinned
    sdist_sha256: str  # of the sdist pip downloads: a changed upload is refused
    function: str  # what the bug broke, for the agent to grep
    issue: str  # the issue text the agent works from
    bug: Edit
    hidden_tests: tuple[str, ...]  # pytest node ids, relative to /repo

    @property
    def image(self) -> str:
        return f"tangram-swe/{self.name}:bug"

    @property
    def fix(self) -> Edit:
        return self.bug.reversed()

    @property
    def test_files(self) -> tuple[str, ...]:
        """The files that hold the hidden tests (sent by the reward action, pristine)."""
        return tuple(dict.fromkeys(t.split("::", 1)[0] for t in self.hidden_tests))

    @property
    def test_command(self) -> str:
        return "python3 -m pytest -q -p no:cacheprovider " + " ".join(self.hidden_tests)


TASKS: tuple[SweTask, ...] = (
    SweTask(
        name="inflection",
        project="inflection",
        version="0.5.1",
        sdist_sha256="1a29730d366e996aaacffb2f1f1cb9593dc38e2ddd30c91250c6dde09ea9b417",
        function="underscore",
        issue="inflection.underscore('HTMLTidy') returns 'htmltidy'; expected 'html_tidy'.",
        # the acronym rule goes: a run of capitals followed by a word is no longer split
        bug=Edit(
            "inflection/__init__.py",
            "    word = re.sub(r\"([A-Z]+)([A-Z][a-z])\", r'\\1_\\2', word)\n"
            "    word = re.sub(r\"([a-z\\d])([A-Z])\", r'\\1_\\2', word)\n",
            "    word = re.sub(r\"([a-z\\d])([A-Z])\", r'\\1_\\2', word)\n",
        ),
        hidden_tests=("test_inflection.py::test_underscore",),
    ),
    SweTask(
        name="toolz",
        project="toolz",
        version="0.12.1",
        sdist_sha256="ecca342664893f177a13dac0e6b41cbd8ac25a358e5f215316d43e2100224f4d",
        function="partition_all",
        issue="toolz.partition_all(3, range(5)) yields a padded last tuple; expected [(0, 1, 2), (3, 4)].",
        # the length of the short last chunk: a quotient where the remainder belongs
        bug=Edit("toolz/itertoolz.py", "yield prev[:len(seq) % n]", "yield prev[:len(seq) // n]"),
        hidden_tests=("toolz/tests/test_itertoolz.py::test_partition_all",),
    ),
    SweTask(
        name="more-itertools",
        project="more-itertools",
        version="10.2.0",
        sdist_sha256="8fccb480c43d3e99a00087634c06dd02b0d50fbf088b380de5a41a015ec239e1",
        function="windowed",
        issue="more_itertools.windowed([1, 2, 3, 4, 5], 3, fillvalue='!', step=3) yields "
        "(3, 4, 5) last; expected (4, 5, '!').",
        # one fill value too few when the last step is short: the window slides back instead
        bug=Edit(
            "more_itertools/more.py",
            "        window += (fillvalue,) * i\n",
            "        window += (fillvalue,) * (i - 1)\n",
        ),
        hidden_tests=("tests/test_more.py::WindowedTests::test_fillvalue_step",),
    ),
)


def task(name: str) -> SweTask:
    """The task called `name`; KeyError naming the known ones otherwise."""
    for t in TASKS:
        if t.name == name:
            return t
    raise KeyError(f"no SWE task {name!r}; known: {', '.join(t.name for t in TASKS)}")
