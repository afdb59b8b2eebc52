"""What one request runs: files, compile phase, then code, test cases (in parallel over the granted
cores) or a test command (`pytest` under the harness), and the facts reported back."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from tangram_runner import boot, build, fs, langs, session, suite
from tangram_runner.proc import Action, Proc, Zygote, code_memfd
from tangram_runner.protocol import Facts, PhaseFacts, RunRequest, Seat, SuiteFacts, TestFacts
from tangram_runner.tests import run_tests

_ENOSPC = ("No space left on device", "Disk quota exceeded", "File too large")
# what a program says when its allocator or runtime ran out (before the cgroup's OOM killer):
# C, C++, Python, Java, Node.js (V8's heap cap), Go, Rust
_MEMERR = (
    "MemoryError",
    "Cannot allocate memory",
    "std::bad_alloc",
    "java.lang.OutOfMemoryError",
    "JavaScript heap out of memory",
    "fatal error: runtime: out of memory",
    "memory allocation of",
)
_FORKERR = ("Resource temporarily unavailable", "BlockingIOError: [Errno 11]")
DEFAULT_COMPILE_TIMEOUT_S = 10.0
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _text(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def _wait_for(act: Action, proc: Proc | None) -> bool:
    """Pump until `proc` ended; False on deadline or output cap."""
    while proc is not None and proc.returncode is None:
        if act.wait_any() is None:
            return False
    return proc is not None


def trusted_path(req: RunRequest) -> list[str]:
    """Where the verifier imports from: the interpreter's own read-only directories and the
    host-provided tools, never the workdir or the user's site-packages."""
    return boot.own_paths() + list(req.pythonpath)


def handle(
    req: RunRequest, seat: Seat, zygote: Zygote, control: Callable[[Action], None] | None = None
) -> dict:
    """Run one request in the runner's `seat` to completion and return its facts
    (`protocol.Facts`, as sent); `control(act)` lets the host's requests reach the action while
    it runs (`control`)."""
    t_wall = time.time()
    fs.reset_tops(seat)
    marks = fs.inode_marks(seat)
    act = Action(req, seat, zygote)
    if control is not None:
        control(act)
    held: list[Any] = []  # descriptors and channels to close at the end
    facts = Facts()
    try:
        facts = _run(req, act, held)
    finally:
        act.end()
        act.close()
        build.end_action()  # failed or uncached builds (their compilers are gone now)
        for h in held:
            h.close() if isinstance(h, suite.Channel) else os.close(h)
        if fs.disk_full(seat):
            facts = facts._replace(rolled_back=tuple(fs.roll_back(seat, marks, t_wall)))
        if req.fetch_files:
            facts = facts._replace(files=fs.fetch_files(req, seat))
    return facts.to_dict()


WARM_UP_CODE = "def f(x):\n    return [x, str(x)]\n"
WARM_UP_TEST = "assert f(1) == [1, '1'] and len(f(2)) == 2"


def harness_request(**fields: Any) -> RunRequest:
    """A request of the harness's own (`warm_up`, `proc.prime`): no code, files or tests, and
    no limit but those in `fields`."""
    bare = RunRequest(
        language="python",
        code=None,
        tools={},
        memory_mb=0,
        compile_memory_mb=0,
        files={},
        binary_files={},
        fetch_files=[],
        max_fetch_bytes=0,
        test_command=None,
        test_cases=[],
        stdin=None,
        timeout_s=0.0,
        compile_timeout_s=0.0,
        cores=[],
        nofile=0,  # the default (`launch.DEFAULT_NOFILE`)
        max_output_bytes=0,
        env={},
        pythonpath=[],
        key="",
        verifier_group="",
    )
    return bare._replace(**fields)


def warm_up(base: RunRequest, seat: Seat, zygote: Zygote) -> bool:
    """One assert test of the harness's own (no user's code, no file written) through a pooled
    verifier: starts one if none is idle, and takes the first-use costs of the runner, the
    zygote and the verifier (copy-on-write faults, cold paths) off the next occupant's first
    action. True when it passed."""
    req = base._replace(
        language="python",
        timeout_s=10.0,
        max_output_bytes=4096,
        cores=[],
        test_cases=[{"name": "warm-up", "assert_code": WARM_UP_TEST}],
    )
    act = Action(req, seat, zygote)
    code_fd = code_memfd(act, WARM_UP_CODE, langs.UNITS["python"])
    try:
        tests, _ = run_tests(req, act, 1, code_fd, trusted_path(req), None)
    finally:
        act.end()
        act.close()
        os.close(code_fd)
        for p in act.procs:  # it judged the harness's own test only: no user code talked to it
            if p.verifier is not None:
                p.verifier.used = False
    return bool(tests) and bool(tests[0]["passed"])


def _run(req: RunRequest, act: Action, held: list[Any]) -> Facts:
    """One action, or one of its two phases: `phase` "compile" writes the files and compiles
    (its build held for the run), "run" runs what that compile built; absent, both (the host
    splits them when the compile gets more memory than the program: `pool._phases`)."""
    t0 = time.monotonic()
    phase = req.phase
    lang, code = req.language, req.code
    src = langs.unit(lang, code)
    if phase == "run":
        built = build.take_held(str(req.key))
        if built is None:
            return _facts(act, t0, setup_error="the build of the compile phase is gone")
        return _run_phase(req, act, held, t0, src, None, built)
    why = fs.write_files(req, act.seat)
    if why is not None:
        return _facts(act, t0, setup_error=why)
    if req.session:  # bash in the sandbox's shell session (`session`)
        main, info = session.SESSION.run(act, req.tools.get("bash", "/bin/bash"))
        why = None if main is not None else act.spawn_error or "the session shell did not start"
        return _facts(act, t0, main=main, setup_error=why)._replace(session=info)
    code_fd = None
    if lang == "python":  # without code, tests still run an (empty) main module
        code_fd = code_memfd(act, code or "", langs.UNITS["python"])
        held.append(code_fd)
    compile_out, built = None, None
    if lang in langs.COMPILED and code is not None:
        compile_out, built = _compile(req, act, src)
        if built is not None and phase == "compile":
            build.hold(str(req.key), built)
            return _facts(act, t0, compile_out=compile_out)
        if built is None:
            tests = [{"name": c["name"], "passed": False, "detail": "compile failed"} for c in req.test_cases]
            return _facts(act, t0, tests=tests, compile_out=compile_out, compile_failed=True)
    elif lang in langs.COMPILED and req.test_cases:
        why = f"{lang} test cases need code to compile"
        tests = [{"name": c["name"], "passed": False, "detail": why} for c in req.test_cases]
        return _facts(act, t0, tests=tests, setup_error=why)
    return _run_phase(req, act, held, t0, src, code_fd, built, compile_out)


def _run_phase(
    req: RunRequest,
    act: Action,
    held: list[Any],
    t0: float,
    src: str,
    code_fd: int | None,
    built: str | None,
    compile_out: dict[str, Any] | None = None,
) -> Facts:
    """The run phase: the program (`src`, from `built` for a compiled language), its test
    cases or the test command, under the run's own time limit."""
    lang, code = req.language, req.code
    mem = int(req.memory_mb or 512)
    argv = langs.run_argv(lang, req.tools, built, src, mem, req.interpreter) if code is not None else None
    act.set_deadline(float(req.timeout_s))  # the run phase's own limit starts now
    dop = max(1, len(act.req.cores))  # the action's: a resize may have come during the compile
    if req.test_command:
        cmd = req.test_command
        channel = suite.Channel()
        held.append(channel)
        act.watch(channel.sock.fileno(), channel.on_readable)
        python = req.interpreter or sys.executable
        image = req.interpreter is not None  # the image's pytest: shards, not xdist
        argv = ["/bin/bash", "-c", suite.rewrite(cmd, dop, PACKAGE_DIR, req.pythonpath, python, image)]
        main = act.spawn("command", req.stdin, argv=argv, extra_fd=channel.child_fd)
        _wait_for(act, main)
        channel.on_readable()  # what the last session sent just before it exited
        verdict = None
        if suite.mentions_pytest(cmd):
            verdict = suite.verdict(channel, main.returncode if main else None)
        return _facts(act, t0, main=main, suite_verdict=verdict)
    if req.test_cases:
        tests, first = run_tests(req, act, dop, code_fd, trusted_path(req), argv)
        return _facts(act, t0, first=first, tests=tests, compile_out=compile_out)
    if code is not None:
        py = langs.UNITS["python"] if argv is None else None
        main = act.spawn("main", req.stdin, argv=argv, python=py, code_fd=code_fd)
        _wait_for(act, main)
        return _facts(act, t0, main=main, compile_out=compile_out)
    return _facts(act, t0, compile_out=compile_out)


def _compile(req: RunRequest, act: Action, src: str) -> tuple[dict[str, Any], str | None]:
    """The compile phase under its own time limit: the compiler's outcome, and the sealed build
    directory (None when the compile failed). A build of the same program from the same files
    earlier in the trajectory is reused (`build`)."""
    t0 = time.monotonic()
    lang, tools = req.language, req.tools
    mem = int(req.compile_memory_mb or req.memory_mb or 512)
    act.set_deadline(float(req.compile_timeout_s or DEFAULT_COMPILE_TIMEOUT_S))
    try:
        argv = langs.compile_argv(lang, tools, src, "@BUILD", mem)
    except KeyError as e:  # the host sends the tools of every language it accepts
        out = {"exit_code": None, "stdout": "", "stderr": f"tangram: no {e} in this sandbox", "exec_s": 0.0}
        return {**out, "timed_out": False}, None
    key = build.key(lang, argv, langs.compile_env(lang, "@BUILD"), (act.seat.workdir, "/tmp"))
    hit = build.lookup(key)
    if hit is not None:
        out = {"exit_code": 0, "stdout": "", "stderr": "", "exec_s": time.monotonic() - t0}
        return {**out, "timed_out": False, "cached": True}, hit
    where = build.new_dir(int(act.seat.uid))
    argv = langs.compile_argv(lang, tools, src, where, mem)
    cc = act.spawn("compile", None, argv=argv, env=langs.compile_env(lang, where))
    if cc is not None:
        cc.truncate_only = True
    finished = _wait_for(act, cc)
    ok = cc is not None and finished and cc.returncode == 0
    if ok:
        build.seal(where, langs.scratch(lang))
        build.store(key, where)
    return {
        "exit_code": cc.returncode if cc is not None and finished else None,
        "stdout": _text(cc.stdout) if cc else "",
        "stderr": _text(cc.stderr) if cc else act.spawn_error,
        "exec_s": time.monotonic() - t0,
        "timed_out": act.timed_out,
    }, (where if ok else None)


def _facts(
    act: Action,
    t0: float,
    main: Proc | None = None,
    first: Proc | None = None,
    tests: list[dict] | None = None,
    compile_out: dict[str, Any] | None = None,
    compile_failed: bool = False,
    suite_verdict: dict[str, Any] | None = None,
    setup_error: str | None = None,
) -> Facts:
    shown = main or first  # with test cases, the action shows the first test's run of the code
    user = [p for p in act.procs if p.user]
    all_err = _text(b"".join(p.stderr for p in user))
    codes = [p.returncode for p in user if p.returncode is not None and not p.killed_by_runner]
    stdout, stderr = (shown.stdout, shown.stderr) if shown is not None else (b"", b"")
    exit_code = main.returncode if main is not None else None
    if compile_failed and compile_out is not None:  # no run phase: show why
        stdout, stderr = compile_out["stdout"].encode(), compile_out["stderr"].encode()
        exit_code = compile_out["exit_code"]
    if setup_error is not None:
        stderr = f"tangram: {setup_error}\n".encode()
    suite = None
    if suite_verdict is not None:
        suite = SuiteFacts(**{k: v for k, v in suite_verdict.items() if k != "tests"})
        tests = suite_verdict["tests"]
    return Facts(
        exit_code=exit_code,
        stdout=_text(stdout),
        stderr=_text(stderr),
        tests=tuple(TestFacts(**t) for t in tests or ()),
        exec_s=time.monotonic() - t0,
        timed_out=act.timed_out,
        output_capped=act.output_capped,
        disk_full=fs.disk_full(act.seat) or any(s in all_err for s in _ENOSPC),
        killed=any(c == -signal.SIGKILL for c in codes),
        memory_error=any(s in all_err for s in _MEMERR),
        fork_failed=act.fork_failed or any(s in all_err for s in _FORKERR),
        compile_failed=compile_failed,
        setup_error=setup_error,
        compile=None if compile_out is None else PhaseFacts(**compile_out),
        suite=suite,
    )
