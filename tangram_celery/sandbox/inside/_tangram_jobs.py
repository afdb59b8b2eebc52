"""What one request runs: files, compile, code, test cases (in parallel over the granted cores) or
a test command (`pytest` rewritten to `pytest -n K`), and the facts reported back."""

from __future__ import annotations

import base64
import os
import re
import signal
import stat
import time

try:
    from tangram_celery.sandbox.inside._tangram_proc import Action, Proc, kill_all
except ImportError:  # inside the sandbox this directory is sys.path[0]
    from _tangram_proc import Action, Proc, kill_all  # type: ignore[no-redef]

UNITS = {"python": "main.py", "bash": "main.sh", "c": "main.c"}
PYTEST = re.compile(r"(^|[;&|(]\s*|\bexec\s+)(python3?\s+-m\s+pytest|pytest)(?=\s|$)")
_ENOSPC = ("No space left on device", "Disk quota exceeded", "File too large")
_MEMERR = ("MemoryError", "Cannot allocate memory", "std::bad_alloc")
_FORKERR = ("Resource temporarily unavailable", "BlockingIOError: [Errno 11]")
DISK_SLACK_B = 256 * 1024  # a workdir with less free space than this counts as full


def _norm(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _text(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def _write_files(req: dict) -> None:
    files: dict = dict(req.get("files", {}))
    for rel, b64 in req.get("binary_files", {}).items():
        files[rel] = base64.b64decode(b64)
    if req.get("code") is not None:
        files[UNITS[req["language"]]] = req["code"]
    for rel, content in files.items():
        path = os.path.join(req["workdir"], rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb" if isinstance(content, bytes) else "w") as f:
            f.write(content)
        os.chown(path, req["uid"], req["uid"])
        d = os.path.dirname(path)
        while d.startswith(req["workdir"]) and d != req["workdir"]:
            os.chown(d, req["uid"], req["uid"])
            d = os.path.dirname(d)


def _run_argv(req: dict) -> list[str] | None:
    lang = req["language"]
    if lang == "bash":
        return ["/bin/bash", UNITS["bash"]]
    if lang == "c":
        return ["./.tangram-main"]
    return None


def handle(req: dict) -> dict:
    """Run one request to completion and return its facts."""
    t0, t_wall = time.monotonic(), time.time()
    marks = _inode_marks(req)
    act = Action(req)
    procs: list[Proc] = []
    tests: list[dict] = []
    facts: dict = {}
    try:
        _write_files(req)
        dop = max(1, len(req["cores"]))
        lang, code = req["language"], req.get("code")
        if lang == "c" and code is not None:
            cc = act.spawn(
                "compile",
                None,
                argv=["/usr/bin/gcc", "-O2", "-pipe", "-o", ".tangram-main", UNITS["c"], "-lm"],
            )
            done = act.wait_any()
            procs.append(cc)
            if done is None or cc.returncode != 0:
                tests = [
                    {"name": c["name"], "passed": False, "detail": "compile failed"}
                    for c in req.get("test_cases", [])
                ]
                facts = _facts(req, act, procs, tests, t0, compile_failed=True)
                return facts
        if req.get("test_command"):
            cmd = req["test_command"]
            if dop > 1 and " -n " not in cmd:
                cmd = PYTEST.sub(lambda m: f"{m.group(1)}python3 -m pytest -n {dop}", cmd)
            else:
                cmd = PYTEST.sub(lambda m: f"{m.group(1)}python3 -m pytest", cmd)
            procs.append(act.spawn("command", req.get("stdin"), argv=["/bin/bash", "-c", cmd]))
            act.wait_any()
        elif req.get("test_cases"):
            tests = _run_tests(req, act, dop, procs)
        elif code is not None:
            py = [(UNITS["python"], code)] if lang == "python" else None
            procs.append(act.spawn("main", req.get("stdin"), argv=_run_argv(req), python=py))
            act.wait_any()
        facts = _facts(req, act, procs, tests, t0)
        return facts
    finally:
        kill_all()
        act.close()
        if _disk_full(req):
            facts["rolled_back"] = _roll_back(req, marks, t_wall)
        if req.get("fetch_files"):
            facts["files"] = _fetch_files(req)


def _fetch_files(req: dict) -> dict:
    """{path: base64} of the requested files, read after every process of the action is gone.

    The runner is root, the paths are the user's: only regular files owned by the sandbox uid,
    resolved inside the workdir or /tmp, opened without following a final symlink, are read;
    anything else, a missing file, or what exceeds `max_fetch_bytes` in all is left out."""
    out: dict = {}
    budget = int(req.get("max_fetch_bytes", 16 << 20))
    roots = tuple(os.path.realpath(r) + os.sep for r in (req["workdir"], "/tmp"))
    for name in req["fetch_files"]:
        path = os.path.realpath(os.path.join(req["workdir"], name))
        if not path.startswith(roots):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != int(req["uid"]) or st.st_size > budget:
                continue
            data = os.read(fd, st.st_size + 1)
            if len(data) > budget:
                continue
            budget -= len(data)
            out[name] = base64.b64encode(data).decode("ascii")
        finally:
            os.close(fd)
    return out


def _inode_marks(req: dict) -> dict[str, tuple[int, int]]:
    """(device, inode number) of a file created now in the workdir and in /tmp. Both are tmpfs
    mounts, which number inodes from a per-mount counter that only grows: a larger number on the
    same device is a file created later. This needs no clock (a stepped wall clock would make an
    mtime test delete older files)."""
    marks = {}
    for top in (req["workdir"], "/tmp"):
        path = os.path.join(top, ".tangram-mark")
        try:
            fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
            try:
                st = os.fstat(fd)
            finally:
                os.close(fd)
                os.unlink(path)
        except OSError:  # full already: every file there predates this action
            st = os.stat(top)
            marks[top] = (st.st_dev, 1 << 62)
            continue
        marks[top] = (st.st_dev, st.st_ino)
    return marks


def _roll_back(req: dict, marks: dict[str, tuple[int, int]], since: float) -> list[str]:
    """Once the action filled the quota, delete the files it created, so the trajectory can go on.
    Only if that frees too little, older files it wrote to since it started go too, largest first.
    Returns the removed paths."""
    created: list[str] = []
    grown: list[tuple[int, str]] = []
    for top, (dev, mark) in marks.items():
        for root, _dirs, names in os.walk(top):
            for name in names:
                path = os.path.join(root, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if st.st_dev == dev and st.st_ino > mark:
                    created.append(path)
                elif st.st_mtime >= since:
                    grown.append((st.st_size, path))
    removed = [p for p in created if _unlink(p)]
    for _size, path in sorted(grown, reverse=True):
        if not _disk_full(req):
            break
        if _unlink(path):
            removed.append(path)
    return removed


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
    except OSError:
        return False
    return True


def _run_tests(req: dict, act: Action, dop: int, procs: list[Proc]) -> list[dict]:
    """Built-in parallel runner: up to `dop` test cases at once under the action's deadline."""
    cases = req["test_cases"]
    code, lang = req.get("code") or "", req["language"]
    results: list[dict | None] = [None] * len(cases)
    running = 0
    nxt = 0
    while nxt < len(cases) or running:
        while running < dop and nxt < len(cases):
            case = cases[nxt]
            if case.get("assert_code") is not None:
                if lang != "python":
                    results[nxt] = {
                        "name": case["name"],
                        "passed": False,
                        "detail": "assert_code tests need language python",
                    }
                    nxt += 1
                    continue
                both = [(UNITS["python"], code), ("<test>", case["assert_code"])]
                procs.append(act.spawn(nxt, case.get("stdin"), python=both))
            else:
                py = [(UNITS["python"], code)] if lang == "python" else None
                procs.append(act.spawn(nxt, case.get("stdin"), argv=_run_argv(req), python=py))
            running += 1
            nxt += 1
        if not running:
            break
        proc = act.wait_any()
        if proc is None:
            break
        running -= 1
        idx = proc.tag
        assert isinstance(idx, int)
        case = cases[idx]
        passed, detail = proc.returncode == 0, ""
        if not passed:
            detail = f"exit {proc.returncode}: {_text(proc.stderr)[-400:]}"
        elif case.get("expected_stdout") is not None:
            got = _text(proc.stdout)
            passed = _norm(got) == _norm(case["expected_stdout"])
            if not passed:
                detail = f"expected {case['expected_stdout'][:200]!r}, got {got[:200]!r}"
        results[idx] = {"name": case["name"], "passed": passed, "detail": detail}
    why = "timeout" if act.timed_out else "output limit" if act.output_capped else "not run"
    return [
        r or {"name": c["name"], "passed": False, "detail": why} for r, c in zip(results, cases, strict=True)
    ]


def _disk_full(req: dict) -> bool:
    for path in (req["workdir"], "/tmp"):
        try:
            st = os.statvfs(path)
        except OSError:
            continue
        if st.f_bavail * st.f_frsize < DISK_SLACK_B or (st.f_files and st.f_favail == 0):
            return True
    return False


def _facts(
    req: dict, act: Action, procs: list[Proc], tests: list[dict], t0: float, compile_failed: bool = False
) -> dict:
    main = procs[-1] if procs and procs[-1].tag in ("compile", "main", "command") else None
    # with test cases, the action's output is that of the first test's run of the code
    shown = ("compile", "main", "command", 0)
    stderr = b"".join(p.stderr for p in procs if p.tag in shown)
    stdout = b"".join(p.stdout for p in procs if p.tag in shown[1:])
    all_err = _text(b"".join(p.stderr for p in procs))
    codes = [p.returncode for p in procs if p.returncode is not None]
    return {
        "exit_code": main.returncode if main is not None else None,
        "stdout": _text(stdout),
        "stderr": _text(stderr),
        "tests": tests,
        "exec_s": time.monotonic() - t0,
        "timed_out": act.timed_out,
        "output_capped": act.output_capped,
        "disk_full": _disk_full(req) or any(s in all_err for s in _ENOSPC),
        "killed": any(c == -signal.SIGKILL for c in codes),
        "memory_error": any(s in all_err for s in _MEMERR),
        "fork_failed": any(s in all_err for s in _FORKERR),
        "compile_failed": compile_failed,
    }
