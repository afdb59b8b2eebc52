"""Hostile code, on both backends: every hard limit has its own status, nothing leaks, and the
sandbox (and the worker) serves the next action afterwards."""

from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import tangram_runner
from tangram_celery.common.actions import ActionStatus
from tangram_celery.sandbox import ExecRequest
from tests.fixtures.common import unavailable
from tests.fixtures.docker import SMALL_LIMITS


def tid() -> str:
    """A trajectory id as a worker gets it from a tenant (`<tenant>/<id>`, issue 37): the
    attacks run with tenants on."""
    return "hostile/h-" + uuid.uuid4().hex[:10]


def run(box: Any, traj: str, **kw: Any) -> Any:
    return box.run(traj, ExecRequest(**kw))


LIST_PROCS = (
    "import os\n"
    "for p in sorted(os.listdir('/proc')):\n"
    "    if p.isdigit() and int(p) != os.getpid():\n"
    "        try:\n"
    "            cmd = open(f'/proc/{p}/cmdline', 'rb').read().replace(b'\\0', b' ').decode()\n"
    "            stat = open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()\n"
    "            uid = os.stat(f'/proc/{p}').st_uid\n"
    "        except FileNotFoundError:\n"
    "            continue  # gone meanwhile\n"
    "        if stat[0] not in 'ZX' and cmd:  # not a zombie or exiting\n"
    "            print(p, uid, cmd)\n"
)


def healthy(box: Any, traj: str) -> None:
    """The same trajectory still runs code, and nothing of the last action is left running:
    only the runner (PID 1), the zygote (root) and idle verifiers (their own uid), besides the
    process that looks."""
    res = run(box, traj, language="python", code=LIST_PROCS)
    assert res.status is ActionStatus.OK, res
    procs = {p: (int(uid), cmd) for p, uid, cmd in (line.split(" ", 2) for line in res.stdout.splitlines())}
    assert "tangram_runner.runner" in procs.get("1", (0, ""))[1], procs
    zygotes = [p for p, (uid, _) in procs.items() if uid == 0 and p != "1"]  # no user code is root
    verifiers = [p for p, (uid, _) in procs.items() if uid == 10002]
    assert len(zygotes) == 1 and set(procs) == {"1", *zygotes, *verifiers}, f"leftover processes: {procs}"


def test_fork_bomb_hits_pids_limit(sandbox_backend: Any) -> None:
    """Given a bash fork bomb, when run, then PIDS_LIMIT and the sandbox serves the next action.

    The script stays alive while the bomb grows: the bare `:(){ :|:& };:` exits at once, and on a
    loaded machine the runner may kill the bomb (end of action) before it reaches the limit."""
    traj = tid()
    res = run(sandbox_backend, traj, language="bash", code=":(){ :|:& };:; sleep 2", timeout_s=5)
    assert res.status is ActionStatus.PIDS_LIMIT, res
    healthy(sandbox_backend, traj)


def test_python_fork_bomb_hits_pids_limit(sandbox_backend: Any) -> None:
    """Given os.fork() in a loop, when run, then PIDS_LIMIT and healthy afterwards."""
    traj = tid()
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    res = run(sandbox_backend, traj, language="python", code=code, timeout_s=3)
    assert res.status is ActionStatus.PIDS_LIMIT, res
    healthy(sandbox_backend, traj)


def test_memory_bomb_hits_memory_limit(sandbox_backend: Any) -> None:
    """Given code growing memory without end under 128 MiB, then MEMORY_LIMIT, then healthy."""
    traj = tid()
    code = "a = []\nwhile True:\n    a.append(bytearray(1 << 20))\n"
    res = run(sandbox_backend, traj, language="python", code=code, memory_mb=128, timeout_s=20)
    assert res.status is ActionStatus.MEMORY_LIMIT, res
    healthy(sandbox_backend, traj)


def test_c_memory_bomb_hits_memory_limit(sandbox_backend: Any, gcc: str) -> None:
    """Given C touching 1 GiB under 128 MiB, when run, then MEMORY_LIMIT."""
    code = (
        "#include <stdlib.h>\n#include <string.h>\nint main(void){for(;;){char*p=malloc(1<<20);"
        "if(!p)return 1;memset(p,1,1<<20);}}\n"
    )
    res = run(sandbox_backend, tid(), language="c", code=code, memory_mb=128, timeout_s=20)
    assert res.status is ActionStatus.MEMORY_LIMIT, res


def test_infinite_loop_times_out(sandbox_backend: Any) -> None:
    """Given `while True: pass` with a 1 s limit, then TIMEOUT within a few seconds."""
    traj = tid()
    t0 = time.monotonic()
    res = run(sandbox_backend, traj, language="python", code="while True:\n    pass\n", timeout_s=1)
    assert res.status is ActionStatus.TIMEOUT
    assert time.monotonic() - t0 < 6
    healthy(sandbox_backend, traj)


def test_sleep_past_timeout_kills_process_tree(sandbox_backend: Any) -> None:
    """Given a shell whose children sleep 100 s, when the 1 s limit hits, then TIMEOUT, all gone."""
    traj = tid()
    res = run(
        sandbox_backend,
        traj,
        language="bash",
        code="sleep 100 & sleep 100 & (sleep 100; echo late) ; wait",
        timeout_s=1,
    )
    assert res.status is ActionStatus.TIMEOUT
    healthy(sandbox_backend, traj)


def test_huge_stdout_hits_output_limit(sandbox_backend: Any) -> None:
    """Given endless stdout, when run, then OUTPUT_LIMIT with output cut at the cap, quickly."""
    traj = tid()
    t0 = time.monotonic()
    res = run(
        sandbox_backend, traj, language="python", code="while True:\n    print('y' * 1000)\n", timeout_s=20
    )
    assert res.status is ActionStatus.OUTPUT_LIMIT
    assert len(res.stdout.encode()) == SMALL_LIMITS["max_output_bytes"]
    assert time.monotonic() - t0 < 10
    healthy(sandbox_backend, traj)


WRITE_FOREVER = "with open({name!r}, {mode!r}) as f:\n    while True:\n        f.write(b'x' * (1 << 20))\n"


@pytest.mark.parametrize(
    ("setup", "writer", "removed", "after"),
    [
        pytest.param(
            "echo keep > old.txt",
            WRITE_FOREVER.format(name="big", mode="wb"),
            "/work/big",
            "cat old.txt; test ! -e big && head -c 1000000 /dev/zero > new && echo ok",
            id="new-file",
        ),
        pytest.param(
            "echo keep > old.txt; echo x > log.txt",
            WRITE_FOREVER.format(name="log.txt", mode="ab"),
            "/work/log.txt",
            "cat old.txt; head -c 1000000 /dev/zero > new && echo ok",
            id="grown-older-file",
        ),
    ],
)
def test_filling_the_disk_hits_disk_limit(
    sandbox_backend: Any, setup: str, writer: str, removed: str, after: str
) -> None:
    """Given code writing past the 16 MiB quota (into a new file, or appending to a file from an
    earlier action), then DISK_LIMIT; the written file is removed (a grown older file only
    because nothing the action created is left to free), untouched files stay, and the
    trajectory can write again."""
    traj = tid()
    first = run(sandbox_backend, traj, language="bash", code=setup)
    assert first.status is ActionStatus.OK, first
    res = run(sandbox_backend, traj, language="python", code=writer, timeout_s=20)
    assert res.status is ActionStatus.DISK_LIMIT, res
    assert removed in res.detail and "old.txt" not in res.detail, res.detail
    nxt = run(sandbox_backend, traj, language="bash", code=after)
    assert (nxt.status, nxt.stdout) == (ActionStatus.OK, "keep\nok\n")


def test_filling_tmp_hits_disk_limit(sandbox_backend: Any) -> None:
    """Given dd filling /tmp, when run, then DISK_LIMIT."""
    res = run(
        sandbox_backend,
        tid(),
        language="bash",
        code="dd if=/dev/zero of=/tmp/fill bs=1M count=100",
        timeout_s=20,
    )
    assert res.status is ActionStatus.DISK_LIMIT, res


def test_network_is_off(sandbox_backend: Any) -> None:
    """Given a host server on 127.0.0.1, when sandboxed code connects to it, then that fails (the
    sandbox's loopback is its own; no other address is ever a target, not even to show it blocked)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.setblocking(False)  # a connection made would wait in the backlog: no thread left blocked
    port = srv.getsockname()[1]
    code = (
        f"import socket\nfor addr in [('127.0.0.1', {port})]:\n"
        "    try:\n        socket.create_connection(addr, timeout=2)\n        print('OPEN')\n"
        "    except OSError as e:\n        print('blocked', e.errno)\n"
    )
    try:
        res = run(sandbox_backend, tid(), language="python", code=code)
        try:
            accepted = [srv.accept()]
        except BlockingIOError:
            accepted = []
    finally:
        srv.close()
    assert res.stdout.count("blocked") == 1 and "OPEN" not in res.stdout, res
    assert not accepted


def test_no_secrets_from_host_or_worker(sandbox_backend: Any) -> None:
    """Given a secret in the worker's env, when code reads /etc/shadow, /proc/*/environ and its
    env, then nothing of it is visible."""
    os.environ["TANGRAM_TEST_SECRET"] = "s3cr3t-value"
    try:
        code = (
            "import os, glob\n"
            "try:\n    print(open('/etc/shadow').read())\nexcept OSError as e:\n"
            "    print('shadow', e.errno)\n"
            "for p in glob.glob('/proc/[0-9]*/environ'):\n"
            "    try:\n        print(open(p, 'rb').read())\n    except OSError:\n        pass\n"
            "print(dict(os.environ))\n"
            "print(os.path.exists('/root'), os.path.exists('/home'), os.path.exists('/work/main'))\n"
        )
        res = run(sandbox_backend, tid(), language="python", code=code)
    finally:
        del os.environ["TANGRAM_TEST_SECRET"]
    assert res.status is ActionStatus.OK, res
    assert "s3cr3t" not in res.stdout + res.stderr
    assert "shadow 2" in res.stdout or "shadow 13" in res.stdout
    assert "False False False" in res.stdout


def test_host_paths_are_read_only(sandbox_backend: Any) -> None:
    """Given writes to /usr, /bin and /, when run, then every one is refused."""
    code = (
        "for p in ['/usr/evil', '/bin/evil', '/evil', '/opt/tangram/evil']:\n"
        "    try:\n        open(p, 'w').write('x')\n        print('WROTE', p)\n"
        "    except OSError as e:\n        print('refused', e.errno)\n"
    )
    res = run(sandbox_backend, tid(), language="python", code=code)
    assert res.stdout.count("refused") == 4, res
    assert not os.path.exists("/usr/evil")


def test_killing_pid1_and_everything_fails_harmlessly(sandbox_backend: Any) -> None:
    """Given code that signals PID 1 and kill -9 -1, when run, then the runner survives."""
    traj = tid()
    res = run(
        sandbox_backend, traj, language="bash", code="kill -9 1; kill -TERM 1; kill -9 -1; echo still-here"
    )
    assert res.status in (ActionStatus.OK, ActionStatus.FAILED, ActionStatus.TIMEOUT)
    healthy(sandbox_backend, traj)
    res = run(
        sandbox_backend,
        traj,
        language="python",
        code="import os\ntry:\n    os.kill(1, 9)\nexcept OSError as e:\n    print(e.errno)",
    )
    assert res.stdout.strip() == "1"  # EPERM
    healthy(sandbox_backend, traj)


def test_runner_socket_is_unreachable(sandbox_backend: Any) -> None:
    """Given user code, when it looks for the runner's socket, then access is denied."""
    res = run(sandbox_backend, tid(), language="bash", code="ls /run/tangram 2>&1; echo rc=$?")
    assert "runner.sock" not in res.stdout and "rc=2" in res.stdout


def test_daemon_does_not_outlive_its_action(sandbox_backend: Any) -> None:
    """Given a double-forked daemon that writes a file after 1 s, when the next action runs 2 s
    later, then the daemon is gone and never wrote."""
    traj = tid()
    code = (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        time.sleep(1)\n        open('/work/daemon_was_here', 'w').write('x')\n"
        "    os._exit(0)\nprint('parent done')\n"
    )
    res = run(sandbox_backend, traj, language="python", code=code)
    assert res.status is ActionStatus.OK and res.exec_s < 1
    time.sleep(2)
    res = run(sandbox_backend, traj, language="bash", code="ls /work")
    assert "daemon_was_here" not in res.stdout
    healthy(sandbox_backend, traj)


def test_no_files_left_for_the_next_trajectory(sandbox_backend: Any) -> None:
    """Given a trajectory leaving files in /work and /tmp, when another trajectory looks, then it
    sees none of them, now or after the first is closed."""
    a, b = tid(), tid()
    run(sandbox_backend, a, language="bash", code="echo a > /work/left; echo a > /tmp/left")
    look = "ls -A /work /tmp"
    res_b = run(sandbox_backend, b, language="bash", code=look)
    assert "left" not in res_b.stdout
    sandbox_backend.close_trajectory(a)
    res_b = run(sandbox_backend, b, language="bash", code=look)
    assert "left" not in res_b.stdout


def test_setuid_binaries_do_not_escalate(sandbox_backend: Any) -> None:
    """Given setuid binaries from the host's /usr, when user code runs them, then it stays 10001."""
    code = "for b in /usr/bin/su /usr/bin/sudo /usr/bin/passwd; do [ -x $b ] && $b -h >/dev/null 2>&1; done; id -u"
    res = run(sandbox_backend, tid(), language="bash", code=code)
    assert res.stdout.strip().splitlines()[-1] == "10001"


PLANT = (
    "ln -s /run/tangram lnk_run; ln -s /opt/tangram lnk_opt; ln -s /proc/1/root lnk_root; "
    "ln -s /proc/1/cwd lnk_cwd; ln -s /proc/1/fd lnk_fd; ln -s /run/tangram/owned main.py; "
    "mkfifo fifo; ln -s /run/tangram/runner.sock .tangram-mark; ln -s /run/tangram/runner.sock "
    "/tmp/.tangram-mark; echo planted; chmod 000 /work /tmp"
)


def test_planted_links_do_not_redirect_privileged_writes(sandbox_backend: Any) -> None:
    """Given links planted by one action (to the runner-state dir, the runner's code, /proc/1's
    root, cwd and descriptors; main.py as a link; a FIFO; /work and /tmp made inaccessible),
    when later actions write `files`
    through them and write their code, then writes through a link into those places fail as the
    user's own would (FAILED), the code replaces the link, the FIFO is replaced without hanging,
    and on the host the state dir is untouched: still root's, mode 0700, nothing new in it."""
    traj = tid()
    assert run(sandbox_backend, traj, language="bash", code=PLANT).stdout == "planted\n"
    state_dir = sandbox_backend._handles[traj].state_dir
    before = sorted(p.name for p in state_dir.iterdir())
    for entry in ("lnk_run/x", "lnk_run/sub/x", "lnk_opt/runner/x", "lnk_root/x", "lnk_cwd/x", "lnk_fd/x"):
        res = run(sandbox_backend, traj, language="python", code="print('ran')", files={entry: "pwned"})
        assert res.status is ActionStatus.FAILED and "cannot write files entry" in res.detail, (entry, res)
        assert "ran" not in res.stdout
    res = run(
        sandbox_backend, traj, language="python", code="print('ran')", files={"fifo": "data"}, timeout_s=5
    )
    assert (res.status, res.stdout) == (ActionStatus.OK, "ran\n"), res
    res = run(sandbox_backend, traj, language="bash", code="cat fifo; test -L main.py || echo main-replaced")
    assert "data" in res.stdout and "main-replaced" in res.stdout, res
    st = state_dir.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o700)
    assert sorted(p.name for p in state_dir.iterdir()) == before
    assert not (Path(tangram_runner.__file__).parent / "x").exists()
    healthy(sandbox_backend, traj)


def test_user_code_gets_no_user_namespace_and_runs_under_seccomp(sandbox_backend: Any) -> None:
    """Given user code trying `unshare -Ur` (uid 0 in a new user namespace), unshare and clone
    with CLONE_NEWUSER, clone3 and mount, when run, then each fails, the process has seccomp
    filtering, no new privileges and a 1024 descriptor limit."""
    code = (
        "import ctypes, os, subprocess\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "r = subprocess.run(['unshare', '-Ur', 'id', '-u'], capture_output=True, text=True)\n"
        "print('unshare-cmd', r.returncode, r.stdout.strip() or '-')\n"
        "print('unshare', libc.unshare(0x10000000), ctypes.get_errno())\n"
        "print('clone', libc.syscall(56 if os.uname().machine == 'x86_64' else 220, 0x10000011, 0, 0, 0, 0),"
        " ctypes.get_errno())\n"
        "print('clone3', libc.syscall(435, 0, 0), ctypes.get_errno())\n"
        "print('mount', libc.mount(b'none', b'/tmp', b'tmpfs', 0, None), ctypes.get_errno())\n"
        "status = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
        "print('seccomp', status['Seccomp'].strip(), status['NoNewPrivs'].strip())\n"
        "import resource\nprint('nofile', resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    res = run(sandbox_backend, tid(), language="python", code=code)
    assert res.status is ActionStatus.OK, res
    out = dict(line.split(" ", 1) for line in res.stdout.splitlines())
    rc, uid = out["unshare-cmd"].split()
    assert rc != "0" and uid != "0", res
    assert out["unshare"] == "-1 1" and out["clone"] == "-1 1" and out["clone3"] == "-1 38"
    assert out["mount"].startswith("-1 ")
    assert out["seccomp"] == "2 1" and out["nofile"] == "1024"


def test_inode_exhaustion_is_a_disk_limit_and_is_rolled_back(sandbox_backend: Any) -> None:
    """Given code creating empty files until the workdir has no inodes left, when run, then
    DISK_LIMIT (not a memory limit), the files it created are removed, and the trajectory's next
    action can create files again."""
    traj = tid()
    probe = run(
        sandbox_backend, traj, language="python", code="import os; print(os.statvfs('/work').f_files)"
    )
    if int(probe.stdout) > 500_000:
        unavailable("no inode cap (nr_inodes) on the sandbox's /work tmpfs: the backend must set one")
    code = "i = 0\nwhile True:\n    open(f'f{i}', 'w').close()\n    i += 1\n"
    res = run(sandbox_backend, traj, language="python", code=code, timeout_s=30)
    assert res.status is ActionStatus.DISK_LIMIT, res
    assert "removed" in res.detail and "/work/f" in res.detail, res.detail
    nxt = run(sandbox_backend, traj, language="bash", code="test ! -e f0 && touch new && echo ok")
    assert (nxt.status, nxt.stdout) == (ActionStatus.OK, "ok\n"), nxt
    healthy(sandbox_backend, traj)
