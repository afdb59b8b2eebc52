"""Every compiled or added language in one shared sandbox backend: compile phase with its own
limit, the same statuses and limits as Python, the verdict decided by the harness, and the
per-trajectory build cache that user code cannot tamper with."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from tangram_celery.common.actions import COMPILED_LANGUAGES, ActionStatus, TestCase
from tangram_celery.sandbox import ExecRequest
from tests.fixtures.docker import SMALL_LIMITS
from tests.fixtures.sandbox import require_sandbox
from tests.problems.languages import FAILING, NEW_LANGUAGES, language_problems

COMPILE_S = 30.0  # javac / rustc need 1-2 s idle; this machine is shared and loaded
_seq = itertools.count()


@pytest.fixture(scope="module")
def box(toolchains: list[str]) -> Iterator[Any]:
    """One namespace-backend sandbox for the module (each test its own trajectory)."""
    from tangram_celery.common.config import SandboxConfig
    from tangram_celery.sandbox import open_sandbox

    settings: dict[str, Any] = {"backend": "namespace", **SMALL_LIMITS}
    require_sandbox(settings)
    sandbox = open_sandbox(SandboxConfig.model_validate(settings))
    try:
        yield sandbox
    finally:
        sandbox.close()


def run(box: Any, language: str, code: str, traj: str | None = None, **kw: Any) -> Any:
    kw.setdefault("timeout_s", 10.0)
    kw.setdefault("compile_timeout_s", COMPILE_S)
    req = ExecRequest(language=language, code=code, **kw)
    traj = traj or f"lang-{language}-{next(_seq)}"
    return box.run(traj, req)


def cases(stdin: str = "", expected: str = "x") -> list[TestCase]:
    return [TestCase(name="t0", stdin=stdin, expected_stdout=expected)]


@pytest.mark.parametrize("language", NEW_LANGUAGES)
def test_reference_passes_and_broken_fails(box: Any, language: str) -> None:
    """Given a language's problems, when run with tests, then references pass and broken ones fail."""
    for p in (p for p in language_problems() if p.language == language):
        traj = f"lang-suite-{p.name}"
        good = run(box, language, p.reference, traj, test_cases=p.tests)
        assert good.status is ActionStatus.OK, (p.name, good.tests, good.stderr[-500:])
        bad = run(box, language, p.broken, traj, test_cases=p.tests)
        assert bad.status is ActionStatus.FAILED, (p.name, bad.tests)
        assert not all(t.passed for t in bad.tests)
        box.close_trajectory(traj)


@pytest.mark.parametrize("language", NEW_LANGUAGES)
def test_compile_error_is_a_failed_compile_phase(box: Any, language: str) -> None:
    """Given code that does not compile, then the action FAILED and the compile phase says why."""
    res = run(box, language, FAILING[language]["compile_error"], test_cases=cases())
    assert res.status is ActionStatus.FAILED
    assert res.tests and not res.tests[0].passed
    if language in COMPILED_LANGUAGES:
        assert res.compile is not None and res.compile.exit_code not in (0, None)
        assert res.compile.stderr.strip() and not res.compile.timed_out
        assert res.tests[0].detail == "compile failed"
    else:  # Node.js has no compile phase: the run fails
        assert res.compile is None and "SyntaxError" in res.stderr


@pytest.mark.parametrize("language", NEW_LANGUAGES)
def test_runtime_error_fails_the_run(box: Any, language: str) -> None:
    """Given code that compiles and then crashes, then FAILED with a non-zero exit and its stderr."""
    res = run(box, language, FAILING[language]["runtime_error"])
    assert res.status is ActionStatus.FAILED
    assert res.exit_code not in (0, None)
    assert "boom" in res.stderr
    if language in COMPILED_LANGUAGES:
        assert res.compile is not None and res.compile.exit_code == 0


@pytest.mark.parametrize("language", NEW_LANGUAGES)
def test_endless_loop_times_out_in_the_run_phase(box: Any, language: str) -> None:
    """Given an endless loop, then TIMEOUT after the run limit, the compile phase having passed."""
    res = run(box, language, FAILING[language]["timeout"], timeout_s=1.5)
    assert res.status is ActionStatus.TIMEOUT
    if language in COMPILED_LANGUAGES:
        assert res.compile is not None and res.compile.exit_code == 0


@pytest.mark.parametrize("language", NEW_LANGUAGES)
def test_memory_hog_hits_the_memory_limit(box: Any, language: str) -> None:
    """Given a program allocating without end, then MEMORY_LIMIT (the runtime's error or the OOM kill)."""
    res = run(box, language, FAILING[language]["memory"], memory_mb=256)
    assert res.status is ActionStatus.MEMORY_LIMIT, (res.exit_code, res.stderr[-300:])


@pytest.mark.parametrize("language", ["c", "cpp", "go", "rust"])  # no JVM runs in 32 MiB
def test_a_small_memory_limit_binds_the_program_and_not_its_compiler(box: Any, language: str) -> None:
    """Given 32 MiB, far below what the compiler needs (held to it, it thrashed on its own pages
    until the compile limit), then the compile phase has the sandbox's compile memory and ends
    at once; the program runs under the 32 MiB, and one that needs more hits that limit."""
    hello = {
        "c": '#include <stdio.h>\nint main(void){puts("hi");return 0;}\n',
        "cpp": '#include <iostream>\nint main(){std::cout<<"hi"<<std::endl;}\n',
        "go": 'package main\nimport "fmt"\nfunc main(){fmt.Println("hi")}\n',
        "rust": 'fn main(){println!("hi");}\n',
    }[language]
    traj = f"lang-small-{language}"
    res = run(box, language, hello, traj, memory_mb=32)
    assert res.status is ActionStatus.OK, (res.compile, res.stderr[-300:])
    assert res.compile is not None and res.compile.exit_code == 0 and res.stdout == "hi\n"
    if language != "c":  # (FAILING has no C entry)
        hog = run(box, language, FAILING[language]["memory"], traj, memory_mb=32)
        assert hog.status is ActionStatus.MEMORY_LIMIT, (hog.exit_code, hog.stderr[-300:])
        assert hog.compile is not None and hog.compile.exit_code == 0
    box.close_trajectory(traj)


@pytest.mark.parametrize("language", sorted(COMPILED_LANGUAGES))
def test_compile_phase_has_its_own_time_limit(box: Any, language: str) -> None:
    """Given a compile limit too short for the compiler, then TIMEOUT in the compile phase, no run."""
    from tests.problems.languages import _SPECS

    code = _SPECS.get(language, _SPECS["cpp"])["sum"][0] if language != "c" else "int main(void){return 0;}\n"
    res = run(box, language, code, compile_timeout_s=0.001, timeout_s=10.0)
    assert res.status is ActionStatus.TIMEOUT
    assert res.compile is not None and res.compile.timed_out and res.compile.exit_code is None


@pytest.mark.parametrize("language", NEW_LANGUAGES)
def test_exit_status_alone_never_passes_a_test(box: Any, language: str) -> None:
    """Given a program that prints nothing and exits 0, then its stdin/stdout test fails."""
    quiet = {
        "cpp": "int main(){return 0;}\n",
        "nodejs": "process.exit(0);\n",
        "go": "package main\nfunc main(){}\n",
        "java": "public class Main{public static void main(String[] a){System.exit(0);}}\n",
        "rust": "fn main(){std::process::exit(0);}\n",
    }[language]
    res = run(box, language, quiet, test_cases=cases("1 2", "3"))
    assert res.status is ActionStatus.FAILED and not res.tests[0].passed


def test_java_runs_the_public_class_and_several_jvms_fit_the_pids_limit(box: Any) -> None:
    """Given a Java program on 2 cores with 6 cases, then all pass under the sandbox's pids limit."""
    p = next(p for p in language_problems() if p.name == "java_words")
    many = [t.model_copy(update={"name": f"{t.name}-{i}"}) for i in range(2) for t in p.tests]
    res = run(box, "java", p.reference, test_cases=many, cores=(0, 1))
    assert res.status is ActionStatus.OK, res.tests


def test_build_cache_reuses_a_build_and_sees_changed_files(box: Any) -> None:
    """Given the same C++ program twice, then the second compile is cached; a new header is not."""
    traj = "lang-cache"
    code = '#include "k.h"\n#include <cstdio>\nint main(){std::printf("%d\\n",K);}\n'
    first = run(box, "cpp", code, traj, files={"k.h": "#define K 1\n"}, test_cases=cases("", "1"))
    again = run(box, "cpp", code, traj, test_cases=cases("", "1"))
    changed = run(box, "cpp", code, traj, files={"k.h": "#define K 2\n"}, test_cases=cases("", "2"))
    assert [r.status for r in (first, again, changed)] == [ActionStatus.OK] * 3
    assert first.compile is not None and not first.compile.cached
    assert again.compile is not None and again.compile.cached
    assert changed.compile is not None and not changed.compile.cached
    box.close_trajectory(traj)


def test_user_code_cannot_replace_a_cached_binary(box: Any) -> None:
    """Given a cached build, when a later action tries to overwrite or plant builds, then the
    next run of the same program still runs what its source compiles to."""
    traj = "lang-tamper"
    code = '#include <cstdio>\nint main(){std::puts("7");}\n'
    assert run(box, "cpp", code, traj, test_cases=cases("", "7")).status is ActionStatus.OK
    attack = (
        "for d in /tmp/.tangram-build-*; do echo found $d; printf '#!/bin/sh\\necho 8\\n' > $d/main && echo wrote $d; "
        "rm -rf $d && echo removed $d; chmod 777 $d && echo chmod $d; done; "
        "mkdir -p /tmp/.tangram-build-planted; echo done"
    )
    out = run(box, "bash", attack, traj)
    assert "found /tmp/.tangram-build-" in out.stdout
    assert "wrote" not in out.stdout and "removed" not in out.stdout and "chmod /" not in out.stdout
    res = run(box, "cpp", code, traj, test_cases=cases("", "7"))
    assert res.status is ActionStatus.OK
    box.close_trajectory(traj)


def test_a_flood_of_compiler_diagnostics_is_a_failed_compile(box: Any) -> None:
    """Given code whose compile errors exceed the output cap, then FAILED with them truncated,
    not an output limit."""
    code = "int main(){\n" + "".join(f"undeclared_{i}();\n" for i in range(3000)) + "}\n"
    res = run(box, "cpp", code)
    assert res.status is ActionStatus.FAILED
    assert res.compile is not None and res.compile.exit_code not in (0, None)
    assert 0 < len(res.compile.stderr.encode()) <= SMALL_LIMITS["max_output_bytes"]  # type: ignore[operator]


def test_go_ignores_a_go_env_file_planted_in_the_workdir(box: Any) -> None:
    """Given an earlier action that wrote GOFLAGS=-toolexec into $HOME/.config/go/env, then the
    next Go build runs no user code and builds the submitted program."""
    traj = "lang-goenv"
    plant = (
        "mkdir -p .config/go && printf 'GOFLAGS=-toolexec=/work/evil\\n' > .config/go/env && "
        "printf '#!/bin/sh\\necho pwned > /work/pwned; exec \"$@\"\\n' > evil && chmod +x evil"
    )
    assert run(box, "bash", plant, traj).status is ActionStatus.OK
    code = 'package main\nimport "fmt"\nfunc main(){fmt.Println(7)}\n'
    res = run(box, "go", code, traj, test_cases=cases("", "7"))
    assert res.status is ActionStatus.OK, (res.compile, res.tests)
    look = run(box, "bash", "cat .config/go/env; ls pwned 2>&1 || true", traj)
    assert "toolexec" in look.stdout and "No such file" in look.stdout
    box.close_trajectory(traj)
