"""pytest under the harness: what a `pytest` in a `test_command` is rewritten to (stdlib + pytest).

Run as `python3 -E -s pytest_boot.py --tangram-fd N --tangram-path P [pytest args]`, so that
neither the environment nor the working directory nor the user's site-packages are on the path
while pytest is imported (from the read-only tools directory) and while the reporter gets its
per-run nonce from the runner over descriptor N. Only then does the path become what
`python3 -m pytest` would have (working directory first, user site-packages), and pytest runs
with the reporter registered as a plugin object (not by name: nothing in the workdir can shadow
it). The reporter sends every collected count and test report, tagged with the nonce, on a
descriptor it alone holds from then on (close-on-exec: xdist workers and user subprocesses do
not inherit it); the runner passes the suite only on complete, consistent reports.

Shards (`--tangram-shards K`, where xdist cannot be counted on: a container image's own Python
and pytest): this process is then only a launcher. It starts K bootstraps with
`--tangram-shard RUN:I:K` (RUN a fresh id of this launch), each on the same report channel, waits
for all of them and exits with the highest status. Shard I collects as pytest would, then keeps
the tests at positions I, I+K, I+2K... of the collected ids in sorted order (the same split in
every shard, whatever the collection order) and reports its share, the total and a digest of
the sorted ids, so that the runner can check that the shards ran every test exactly once
(`suite.verdict`). Shard 0 writes to the command's stdout and stderr as it runs; the others'
output (stderr folded into stdout) follows when all have ended, one shard after the other.
Stdlib only, Python 3.8+ and pytest 7+ (a Debian image's).

Residual risk, documented in docs/sandbox.md: conftest files, plugins and the tested modules run
inside this process, so code that can edit them can also forge reports. Use `test_cases` for
rewards where that matters.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

NO_TESTS_COLLECTED = 5  # pytest.ExitCode.NO_TESTS_COLLECTED


def make_sender(sock: socket.socket, nonce: str) -> Callable[..., None]:
    def send(event: str, **fields: Any) -> None:
        try:
            sock.send(json.dumps({"nonce": nonce, "event": event, **fields}).encode()[:60000])
        except OSError:
            pass

    return send


def make_reporter(pytest: Any, sock: socket.socket, nonce: str, sharded: bool = False) -> Any:
    send = make_sender(sock, nonce)

    class TangramReporter:
        @pytest.hookimpl(trylast=True)
        def pytest_collection_finish(self, session: Any) -> None:
            send("collected", n=len(session.items))

        def pytest_deselected(self, items: Any) -> None:
            send("deselected", n=len(items))

        def pytest_collectreport(self, report: Any) -> None:
            if report.failed:
                send("collect_error", nodeid=str(report.nodeid)[:500])

        def pytest_runtest_logreport(self, report: Any) -> None:
            send(
                "report",
                nodeid=str(report.nodeid)[:500],
                when=str(report.when),
                outcome=str(report.outcome),
                xfail=hasattr(report, "wasxfail"),
            )

        @pytest.hookimpl(optionalhook=True)
        def pytest_xdist_node_collection_finished(self, node: Any, ids: Any) -> None:
            send("collected", n=len(ids))

        @pytest.hookimpl(trylast=True)
        def pytest_sessionfinish(self, session: Any, exitstatus: Any) -> None:
            if sharded:  # what the process exits with (`make_shard` may have changed it)
                exitstatus = getattr(session, "exitstatus", exitstatus)
            send("finish", exitstatus=int(exitstatus))

    return TangramReporter()


def make_shard(pytest: Any, send: Callable[..., None], run: str, index: int, count: int) -> Any:
    """The plugin that keeps shard `index` of `count` of the collected tests (module doc)."""

    class TangramShard:
        kept, total = 0, 0

        def pytest_report_header(self, config: Any) -> str:
            first = ", ".join(str(index + 1 + j * count) for j in range(3))
            return f"tangram: shard {index + 1} of {count} (tests {first}, ... of the sorted test ids)"

        @pytest.hookimpl(trylast=True)
        def pytest_collection_modifyitems(self, session: Any, config: Any, items: list[Any]) -> None:
            order = sorted(range(len(items)), key=lambda j: (items[j].nodeid, j))
            ids = "\n".join(items[j].nodeid for j in order)
            digest = hashlib.sha256(ids.encode("utf-8", "surrogateescape")).hexdigest()
            mine = set(order[index::count])
            self.total = len(items)
            items[:] = [it for j, it in enumerate(items) if j in mine]
            self.kept = len(items)
            send("shard", run=run, index=index, count=count, total=self.total, digest=digest)

        @pytest.hookimpl(tryfirst=True)
        def pytest_sessionfinish(self, session: Any, exitstatus: Any) -> None:
            # a share with no test (fewer tests than shards) is not pytest's "no tests collected"
            if self.kept == 0 and self.total > 0 and int(exitstatus) == NO_TESTS_COLLECTED:
                session.exitstatus = 0

    return TangramShard()


def launch_shards(count: int, fd: int, path_arg: str, rest: list[str]) -> int:
    """Run `count` shard bootstraps on report descriptor `fd` and wait for all of them; the
    highest exit status (a signal's as the shell gives it, 128 + N)."""
    import subprocess
    import tempfile

    run = os.urandom(8).hex()
    me = [sys.executable, "-E", "-s", os.path.abspath(__file__), "--tangram-fd", str(fd)]
    me += ["--tangram-path", path_arg]
    started: list[tuple[Any, Any]] = []
    sys.stdout.write(f"======== tangram: shard 1 of {count} (the others' output follows it) ========\n")
    sys.stdout.flush()
    try:
        for i in range(count):
            out = None if i == 0 else tempfile.TemporaryFile()  # noqa: SIM115 (read back below)
            err = None if out is None else subprocess.STDOUT
            argv = [*me, "--tangram-shard", f"{run}:{i}:{count}", *rest]
            started.append((subprocess.Popen(argv, pass_fds=(fd,), stdout=out, stderr=err), out))
    except OSError as e:
        print(f"tangram: could not start shard {len(started)} of {count}: {e}", file=sys.stderr)
        for p, _ in started:
            p.kill()
    os.close(fd)
    codes = [p.wait() for p, _ in started]
    for i, (_, out) in enumerate(started):
        if out is not None:
            sys.stdout.write(f"\n======== tangram: shard {i + 1} of {count} ========\n")
            sys.stdout.flush()
            out.seek(0)
            while True:
                chunk = out.read(1 << 16)
                if not chunk:
                    break
                sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
    statuses = [128 - c if c < 0 else c for c in codes]
    return max(statuses) if len(started) == count else max([1, *statuses])


def main() -> None:
    args = sys.argv[1:]
    if len(args) < 4 or args[0] != "--tangram-fd" or args[2] != "--tangram-path":
        raise SystemExit(
            "usage: pytest_boot.py --tangram-fd N --tangram-path P"
            " [--tangram-shards K | --tangram-shard RUN:I:K] [pytest args]"
        )
    fd, tools, rest = int(args[1]), [p for p in args[3].split(":") if p], args[4:]
    stdlib = [p for p in sys.path if p.startswith("/usr/")]
    sys.path[:] = [*tools, *stdlib]
    if rest[:1] == ["--tangram-shards"]:
        raise SystemExit(launch_shards(max(1, int(rest[1])), fd, args[3], rest[2:]))
    shard = None
    if rest[:1] == ["--tangram-shard"]:
        run, index, count = rest[1].split(":")
        shard, rest = (run, int(index), int(count)), rest[2:]
    import pytest  # from the tools directory, before any user directory is on the path

    sock = socket.socket(fileno=fd)
    os.set_inheritable(fd, False)
    sock.send(b"hello")
    nonce = sock.recv(64).decode("ascii", "replace")
    reporter = make_reporter(pytest, sock, nonce, sharded=shard is not None)
    plugins = [reporter]
    if shard is not None:
        plugins.append(make_shard(pytest, make_sender(sock, nonce), *shard))
    cwd = os.getcwd()
    sys.path[:] = [cwd, *tools, *stdlib]
    home = os.environ.get("HOME", cwd)
    user_site = f"{home}/.local/lib/python{sys.version_info[0]}.{sys.version_info[1]}/site-packages"
    if os.path.isdir(user_site):
        import site

        site.addsitedir(user_site)
    sys.argv[0] = "pytest"
    raise SystemExit(pytest.main(rest, plugins=plugins))


if __name__ == "__main__":
    main()
