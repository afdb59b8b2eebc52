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

Residual risk, documented in docs/sandbox.md: conftest files, plugins and the tested modules run
inside this process, so code that can edit them can also forge reports. Use `test_cases` for
rewards where that matters.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from typing import Any


def make_reporter(pytest: Any, sock: socket.socket, nonce: str) -> Any:
    def send(event: str, **fields: Any) -> None:
        try:
            sock.send(json.dumps({"nonce": nonce, "event": event, **fields}).encode()[:60000])
        except OSError:
            pass

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
            send("finish", exitstatus=int(exitstatus))

    return TangramReporter()


def main() -> None:
    args = sys.argv[1:]
    if len(args) < 4 or args[0] != "--tangram-fd" or args[2] != "--tangram-path":
        raise SystemExit("usage: pytest_boot.py --tangram-fd N --tangram-path P [pytest args]")
    fd, tools, rest = int(args[1]), [p for p in args[3].split(":") if p], args[4:]
    stdlib = [p for p in sys.path if p.startswith("/usr/")]
    sys.path[:] = [*tools, *stdlib]
    import pytest  # from the tools directory, before any user directory is on the path

    sock = socket.socket(fileno=fd)
    os.set_inheritable(fd, False)
    sock.send(b"hello")
    nonce = sock.recv(64).decode("ascii", "replace")
    reporter = make_reporter(pytest, sock, nonce)
    cwd = os.getcwd()
    sys.path[:] = [cwd, *tools, *stdlib]
    home = os.environ.get("HOME", cwd)
    user_site = f"{home}/.local/lib/python{sys.version_info[0]}.{sys.version_info[1]}/site-packages"
    if os.path.isdir(user_site):
        import site

        site.addsitedir(user_site)
    sys.argv[0] = "pytest"
    raise SystemExit(pytest.main(rest, plugins=[reporter]))


if __name__ == "__main__":
    main()
