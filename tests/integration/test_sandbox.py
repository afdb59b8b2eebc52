"""Sandbox backends, for real (private dockerd / bubblewrap): languages, tests, warm state, cores."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from tangram_celery.common.actions import ActionStatus, TestCase
from tangram_celery.sandbox import ExecRequest

C_SUM = '#include <stdio.h>\nint main(void){long a,b; scanf("%ld %ld",&a,&b); printf("%ld\\n",a+b);}\n'


def tid() -> str:
    return "t-" + uuid.uuid4().hex[:10]


def run(box: Any, traj: str, **kw: Any) -> Any:
    return box.run(traj, ExecRequest(**kw))


def test_python_snippet_runs_as_unprivileged_user(sandbox_backend: Any) -> None:
    """Given a sandbox, when a Python snippet runs, then it prints as uid 10001 in /work."""
    res = run(sandbox_backend, tid(), language="python", code="import os; print(os.getuid(), os.getcwd())")
    assert res.status is ActionStatus.OK, res
    assert res.stdout.split() == ["10001", "/work"]
    assert res.exec_s > 0


def test_python_stdin_exit_code_and_stderr(sandbox_backend: Any) -> None:
    """Given a snippet reading stdin and exiting 3, when run, then FAILED with exit 3 and stderr."""
    code = "import sys; d=sys.stdin.read(); print(d.upper()); print('oops', file=sys.stderr); sys.exit(3)"
    res = run(sandbox_backend, tid(), language="python", code=code, stdin="abc")
    assert res.status is ActionStatus.FAILED
    assert (res.exit_code, res.stdout.strip(), res.stderr.strip()) == (3, "ABC", "oops")


def test_python_exception_reports_traceback(sandbox_backend: Any) -> None:
    """Given code raising ValueError, when run, then FAILED, exit 1, and the traceback names the
    program as `python3 main.py` does (its absolute path; `sys.argv[0]` as given)."""
    code = "import sys\nprint(__file__, sys.argv[0])\nraise ValueError('bad')"
    res = run(sandbox_backend, tid(), language="python", code=code)
    assert res.status is ActionStatus.FAILED and res.exit_code == 1
    assert res.stdout == "/work/main.py main.py\n", res.stdout
    assert 'File "/work/main.py", line 3' in res.stderr and "ValueError: bad" in res.stderr
    assert "runner.py" not in res.stderr


def test_bash_and_c(sandbox_backend: Any, gcc: str) -> None:
    """Given bash and C programs, when run, then both work (gcc from the host)."""
    traj = tid()
    res = run(sandbox_backend, traj, language="bash", code="echo $((6*7)); echo err >&2")
    assert (res.status, res.stdout, res.stderr) == (ActionStatus.OK, "42\n", "err\n")
    res = run(sandbox_backend, traj, language="c", code=C_SUM, stdin="40 2")
    assert (res.status, res.stdout) == (ActionStatus.OK, "42\n")


def test_c_compile_error_is_failed(sandbox_backend: Any, gcc: str) -> None:
    """Given C that does not compile, when run, then FAILED with gcc's message, in the compile
    phase's outcome (and, as there is no run, in stderr too)."""
    res = run(sandbox_backend, tid(), language="c", code="int main( { return 0; }")
    assert res.status is ActionStatus.FAILED
    assert "error" in res.stderr
    assert res.compile is not None and res.compile.exit_code not in (0, None)
    assert "error" in res.compile.stderr and not res.compile.timed_out


def test_compile_and_run_phases_are_reported_apart(sandbox_backend: Any, gcc: str) -> None:
    """Given C that compiles with a warning and prints, when run, then the compile phase carries
    the warning and its own time, and stdout/stderr/exit_code are the program's."""
    code = '#include <stdio.h>\nint main(void){int unused; printf("run\\n"); return 0;}\n'
    res = run(sandbox_backend, tid(), language="c", code=code)
    assert (res.status, res.stdout, res.exit_code) == (ActionStatus.OK, "run\n", 0), res
    assert res.compile is not None and res.compile.exit_code == 0 and res.compile.exec_s > 0
    py = run(sandbox_backend, tid(), language="python", code="print(1)")
    assert py.compile is None


def test_compile_phase_has_its_own_time_limit(sandbox_backend: Any, gcc: str) -> None:
    """Given a compile time limit far below what gcc needs, when run, then TIMEOUT with the
    compile phase marked timed out, and the run never starts."""
    res = run(sandbox_backend, tid(), language="c", code=C_SUM, compile_timeout_s=0.001, timeout_s=5)
    assert res.status is ActionStatus.TIMEOUT, res
    assert res.compile is not None and res.compile.timed_out and res.compile.exit_code is None


def test_compiler_gets_room_and_the_program_keeps_its_memory_limit(sandbox_backend: Any, gcc: str) -> None:
    """Given 32 MiB, less than gcc needs, when C is run, then it compiles (under the sandbox's
    compile memory) and runs; a program that allocates 64 MiB is held to the 32 (MEMORY_LIMIT)."""
    traj = tid()
    res = run(sandbox_backend, traj, language="c", code=C_SUM, stdin="40 2", memory_mb=32)
    assert (res.status, res.stdout) == (ActionStatus.OK, "42\n"), (res.compile, res.stderr)
    hog = (  # volatile: gcc would drop an allocation whose contents it can tell
        "#include <stdlib.h>\nint main(void){volatile char*p=malloc(64<<20);"
        "for(long i=0;i<(64<<20);i+=4096)p[i]=1;return p[4096]-1;}\n"
    )
    res = run(sandbox_backend, traj, language="c", code=hog, memory_mb=32)
    assert res.status is ActionStatus.MEMORY_LIMIT, res
    assert res.compile is not None and res.compile.exit_code == 0


def test_stdin_test_cases_in_parallel(sandbox_backend: Any, gcc: str) -> None:
    """Given C with 3 stdin tests (one wrong), when run on 2 cores, then 2 pass and FAILED."""
    cases = [
        TestCase(name="a", stdin="1 2", expected_stdout="3"),
        TestCase(name="b", stdin="-5 5", expected_stdout="0\n"),
        TestCase(name="c", stdin="1 1", expected_stdout="3"),
    ]
    res = run(sandbox_backend, tid(), language="c", code=C_SUM, test_cases=cases, cores=(0, 1))
    assert res.status is ActionStatus.FAILED
    assert [t.passed for t in res.tests] == [True, True, False]
    assert "expected" in res.tests[2].detail


def test_assert_test_cases(sandbox_backend: Any) -> None:
    """Given a function and assert tests, when all pass, then OK with every test passed."""
    cases = [TestCase(name=f"t{i}", assert_code=f"assert sq({i}) == {i * i}") for i in range(6)]
    res = run(
        sandbox_backend,
        tid(),
        language="python",
        code="def sq(x):\n    return x * x\n",
        test_cases=cases,
        cores=(0, 1),
    )
    assert res.status is ActionStatus.OK, res
    assert all(t.passed for t in res.tests) and len(res.tests) == 6


def test_assert_tests_use_classes_generators_exceptions_and_workdir_modules(sandbox_backend: Any) -> None:
    """Given a solution with a stateful class, a generator and a raising function, and a helper
    module in `files`, when assert tests use them (and import the helper), then all pass."""
    code = (
        "from helper import double\n"
        "class Counter:\n    def __init__(self):\n        self.n = 0\n"
        "    def tick(self):\n        self.n += 1\n        return self.n\n"
        "def evens(k):\n    for i in range(k):\n        yield double(i)\n"
        "def root(x):\n    if x < 0:\n        raise ValueError(x)\n    return x ** 0.5\n"
    )
    cases = [
        TestCase(name="cls", assert_code="c = Counter()\nc.tick()\nassert c.tick() == 2 and c.n == 2"),
        TestCase(name="gen", assert_code="assert list(evens(3)) == [0, 2, 4]"),
        TestCase(
            name="exc", assert_code="try:\n    root(-1)\n    assert False\nexcept ValueError:\n    pass"
        ),
        TestCase(name="imp", assert_code="from helper import double\nassert double(4) == 8"),
    ]
    files = {"helper.py": "def double(x):\n    return 2 * x\n"}
    res = run(sandbox_backend, tid(), language="python", code=code, files=files, test_cases=cases)
    assert res.status is ActionStatus.OK and all(t.passed for t in res.tests), res


def test_a_test_that_changes_the_verifier_does_not_change_the_next(sandbox_backend: Any) -> None:
    """Given assert tests run one after the other by pooled verifiers, when the first rebinds a
    builtin and the recursion limit and imports a module from the workdir, then the second sees
    none of it."""
    first = "import builtins, sys\nbuiltins.abs = lambda x: -1\nbuiltins.MARK = 1\nsys.setrecursionlimit(300)\nimport helper"
    second = (
        "import sys\nassert abs(-2) == 2 and 'MARK' not in dir(__builtins__)\n"
        "assert sys.getrecursionlimit() > 300 and 'helper' not in sys.modules"
    )
    cases = [TestCase(name=f"t{i}", assert_code=c) for i, c in enumerate([first, second] * 3)]
    files = {"helper.py": "X = 1\n"}
    res = run(sandbox_backend, tid(), language="python", code="", files=files, test_cases=cases)
    assert res.status is ActionStatus.OK and all(t.passed for t in res.tests), res


def test_a_test_hanging_in_the_verifier_times_out_and_the_next_action_works(sandbox_backend: Any) -> None:
    """Given an assert test whose own code never ends, when run with a 1 s limit, then TIMEOUT,
    and the trajectory's next assert tests pass (the stuck verifier was replaced)."""
    traj = tid()
    hang = [TestCase(name="hang", assert_code="while True:\n    pass")]
    res = run(sandbox_backend, traj, language="python", code="", test_cases=hang, timeout_s=1)
    assert res.status is ActionStatus.TIMEOUT, res
    ok = [TestCase(name="ok", assert_code="assert f() == 1")]
    res = run(sandbox_backend, traj, language="python", code="def f():\n    return 1\n", test_cases=ok)
    assert res.status is ActionStatus.OK, res


def test_parallel_test_cases_use_granted_cores(sandbox_backend: Any) -> None:
    """Given 4 tests sleeping 0.5 s, when run on 2 cores, then about 1 s, not 2 s."""
    cases = [TestCase(name=f"s{i}", assert_code="import time; time.sleep(0.5)") for i in range(4)]
    res = run(sandbox_backend, tid(), language="python", code="", test_cases=cases, cores=(0, 1))
    assert res.status is ActionStatus.OK
    assert 0.9 < res.exec_s < 1.9


def test_pytest_command_gets_n_workers(sandbox_backend: Any) -> None:
    """Given a pytest test_command on 2 cores, when run, then pytest-xdist runs 2 workers."""
    files = {"test_m.py": "def test_a():\n    assert 1\n\ndef test_b():\n    assert 2\n"}
    res = run(
        sandbox_backend,
        tid(),
        language="python",
        code=None,
        files=files,
        test_command="pytest -q -p no:cacheprovider",
        cores=(0, 1),
        timeout_s=60,
    )
    assert res.status is ActionStatus.OK, res.stdout + res.stderr
    assert "2 passed" in res.stdout
    assert "2 workers" in res.stdout or "bringing up nodes" in res.stdout
    # the verdict comes from the harness's report channel, per test
    assert sorted((t.name, t.passed) for t in res.tests) == [
        ("test_m.py::test_a", True),
        ("test_m.py::test_b", True),
    ]


def test_failing_pytest_command_is_failed(sandbox_backend: Any) -> None:
    """Given a failing pytest on 1 core, when run, then FAILED with exit 1 (no xdist)."""
    files = {"test_m.py": "def test_a():\n    assert 0\n"}
    res = run(
        sandbox_backend,
        tid(),
        language="python",
        code=None,
        files=files,
        test_command="python3 -m pytest -q -p no:cacheprovider",
        timeout_s=60,
    )
    assert (res.status, res.exit_code) == (ActionStatus.FAILED, 1)
    assert "1 failed" in res.stdout


def test_files_and_packages_persist_within_trajectory(sandbox_backend: Any) -> None:
    """Given a trajectory that writes a file and a module, when a later action reads, then found."""
    traj = tid()
    run(
        sandbox_backend,
        traj,
        language="bash",
        code="mkdir -p .local/lib/python3.11/site-packages && "
        "echo 'X = 7' > .local/lib/python3.11/site-packages/mymod.py && echo hi > note",
    )
    res = run(
        sandbox_backend,
        traj,
        language="python",
        code="import mymod; print(mymod.X, open('note').read().strip())",
    )
    assert (res.status, res.stdout) == (ActionStatus.OK, "7 hi\n")


def test_close_trajectory_drops_state(sandbox_backend: Any) -> None:
    """Given a trajectory with a file, when closed and reused, then the file is gone."""
    traj = tid()
    run(sandbox_backend, traj, language="bash", code="echo 1 > keep")
    sandbox_backend.close_trajectory(traj)
    sandbox_backend.close_trajectory(traj)  # idempotent
    assert traj not in sandbox_backend.trajectories()
    res = run(sandbox_backend, traj, language="bash", code="cat keep")
    assert res.status is ActionStatus.FAILED


def test_cores_are_bound_per_exec(sandbox_backend: Any) -> None:
    """Given one trajectory, when actions get core 1 then cores 0,1, then each sees its cores."""
    traj = tid()
    code = "import os; print(sorted(os.sched_getaffinity(0)))"
    assert run(sandbox_backend, traj, language="python", code=code, cores=(1,)).stdout == "[1]\n"
    h = sandbox_backend._handles[traj]
    if h.cgroups is not None:
        assert (h.cgroups.dirs["cpuset"] / "cpuset.cpus").read_text().strip() == "1"
    res = run(sandbox_backend, traj, language="python", code=code, cores=(0, 1))
    assert res.stdout == "[0, 1]\n"
    if h.cgroups is not None:
        assert (h.cgroups.dirs["cpuset"] / "cpuset.cpus").read_text().strip() == "0-1"
        quota = h.cgroups.dirs["cpu"] / "cpu.cfs_quota_us"
        if quota.exists():
            assert quota.read_text().strip() == "200000"


def test_env_allowlist_passes_only_given_vars(sandbox_backend: Any) -> None:
    """Given an env allowlist entry, when run, then user code sees it and nothing of the host."""
    res = run(
        sandbox_backend, tid(), language="bash", code="echo $GREETING; env | sort", env={"GREETING": "hello"}
    )
    assert res.stdout.startswith("hello\n")
    names = {line.split("=", 1)[0] for line in res.stdout.splitlines()[1:] if "=" in line}
    assert names <= {
        "GREETING",
        "PATH",
        "HOME",
        "TMPDIR",
        "LANG",
        "PYTHONPATH",
        "PYTHONDONTWRITEBYTECODE",
        "PWD",
        "SHLVL",
        "_",
    }


LOOKS = r"""
import os, sys
for s in (sys.stdin, sys.stdout, sys.stderr):
    print(s.fileno(), s.encoding, s.errors, s.line_buffering, s.seekable(), s.isatty(), s.readable(), s.writable())
print(sys.stdin is sys.__stdin__, sys.stdout is sys.__stdout__, sys.stderr is sys.__stderr__)
print(sorted(k for k in os.environ if k not in ("PWD", "SHLVL", "_")), os.environ.get("GREETING"))
print(sys.stdin.read())
def f(x: int) -> "str": pass
print(f.__annotations__)
"""


@pytest.mark.parametrize("env", [{}, {"GREETING": "hello"}], ids=["standard-env", "extra-env"])
def test_python_program_looks_like_a_fresh_python3(sandbox_backend: Any, env: dict[str, str]) -> None:
    """Given a Python program (a fork of the warm zygote, which makes the standard streams and
    takes the environment on ahead of it), when it looks at its streams and environment, then
    it sees what the same program run by a fresh `python3` sees, with or without variables of
    the caller's; and the next program with other variables does not see these."""
    traj = tid()
    script = "cat > /tmp/looks.py <<'EOF'\n" + LOOKS + "\nEOF\npython3 /tmp/looks.py"
    forked = run(sandbox_backend, traj, language="python", code=LOOKS, stdin="in", env=env)
    fresh = run(sandbox_backend, traj, language="bash", code=script, stdin="in", env=env)
    assert forked.status is ActionStatus.OK and fresh.status is ActionStatus.OK, (forked, fresh)
    assert forked.stdout == fresh.stdout
    assert forked.stdout.splitlines()[:3] == [
        "0 utf-8 surrogateescape False True False True False",
        "1 utf-8 surrogateescape False False False False True",
        "2 utf-8 backslashreplace True False False False True",
    ]
    names = ["HOME", "LANG", "PATH", "PYTHONDONTWRITEBYTECODE", "PYTHONPATH", "TMPDIR", *env]
    assert forked.stdout.splitlines()[3:] == [
        "True True True",
        f"{sorted(names)} {env.get('GREETING')}",
        "in",
        "{'x': <class 'int'>, 'return': 'str'}",
    ]
    other = run(sandbox_backend, traj, language="python", code=LOOKS, env={} if env else {"GREETING": "bye"})
    assert other.stdout.splitlines()[4].endswith("None" if env else "bye")


@pytest.mark.parametrize(
    ("code", "stdout", "exit_code", "stderr_has"),
    [
        ("print(sum(range(5)))\n", "10\n", 0, ""),
        ("x = 1\nif x is 1:\n    print('one')\n", "one\n", 0, "SyntaxWarning"),
        ("print('before')\ndef f(:\n    pass\n", "", 1, "SyntaxError"),
        ("s = 0\n" + "s += 1\n" * 12000 + "print(s)\n", "12000\n", 0, ""),
    ],
    ids=["clean", "syntax-warning", "syntax-error", "large"],
)
def test_a_python_program_compiles_as_under_python3(
    sandbox_backend: Any, code: str, stdout: str, exit_code: int, stderr_has: str
) -> None:
    """Given a program (compiled by the runner when it compiles cleanly; else, or when it is
    long, by its own process), when it runs, then its output, exit code and the compiler's
    words on stderr are those of `python3 main.py`."""
    res = run(sandbox_backend, tid(), language="python", code=code)
    assert (res.stdout, res.exit_code) == (stdout, exit_code), res
    assert stderr_has in res.stderr and (stderr_has or not res.stderr), res.stderr


def test_an_environment_the_process_cannot_take_fails_that_action_only(sandbox_backend: Any) -> None:
    """Given an action whose standard variable holds a NUL byte (no process can have it), when
    it runs, then it fails with the reason and the sandbox's next action runs as usual."""
    traj = tid()
    bad = run(sandbox_backend, traj, language="python", code="print('ran')", env={"LANG": "C.UTF-8\x00x"})
    assert bad.status is not ActionStatus.OK and "ran" not in bad.stdout
    assert "null" in bad.stderr.lower(), bad
    good = run(sandbox_backend, traj, language="python", code="import os; print(os.environ['LANG'])")
    assert good.status is ActionStatus.OK and good.stdout == "C.UTF-8\n", good


def test_idle_sandbox_removed_after_ttl(sandbox_factory: Any) -> None:
    """Given idle_ttl_s=0.5, when a trajectory idles 2 s, then its sandbox is gone."""
    box = sandbox_factory(idle_ttl_s=0.5)
    traj = tid()
    assert run(box, traj, language="python", code="pass").status is ActionStatus.OK
    assert traj in box.trajectories()
    deadline = time.monotonic() + 10
    while traj in box.trajectories() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert traj not in box.trajectories()


def test_sandbox_outlives_the_thread_that_started_it(sandbox_backend: Any) -> None:
    """Given a sandbox started from a thread that then exits, when used again, then still warm."""
    import threading

    traj = tid()
    t = threading.Thread(target=lambda: run(sandbox_backend, traj, language="bash", code="echo 1 > f"))
    t.start()
    t.join()
    time.sleep(0.3)
    res = run(sandbox_backend, traj, language="bash", code="cat f")
    assert (res.status, res.stdout) == (ActionStatus.OK, "1\n")


def test_test_case_action_reports_first_tests_output(sandbox_backend: Any) -> None:
    """Given code that prints and two assert tests, when run, then stdout is the first run's."""
    cases = [TestCase(name="a", assert_code="assert f() == 1"), TestCase(name="b", assert_code="1")]
    res = run(
        sandbox_backend,
        tid(),
        language="python",
        test_cases=cases,
        code="def f():\n    return 1\nprint('hello')\n",
    )
    assert (res.status, res.stdout) == (ActionStatus.OK, "hello\n")
