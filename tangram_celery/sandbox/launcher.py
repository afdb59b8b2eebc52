"""Built-in namespace launcher: the same sandbox as the bubblewrap argv, from direct syscalls.

Standard library only; the worker runs it as root with the host's /usr/bin/python3 (a machine
without bubblewrap still gets a sandbox). Two modes, each given a JSON spec:

- `run SPEC -- ARGV`: the whole sandbox. The launcher arms its parent-death signal and checks
  the worker's lifeline pipe, makes a new pid namespace and forks its PID 1, which arms its own
  parent-death signal (checked with a second pipe: the launcher may have died before), joins
  the sandbox's cgroups, unshares the mount/net/ipc/uts/cgroup namespaces, builds a tmpfs root
  (host /usr /lib /lib64 /bin /sbin read-only or as the same usr-merge symlinks, /proc, a
  minimal /dev, size- and inode-limited tmpfs /work and /tmp, the runner read-only, the
  runner's socket directory), pivots into it, makes it read-only, sets the hostname and
  `finish`es. The launcher stays outside (host namespaces, no cgroup) and exits with PID 1.
- `finish SPEC -- ARGV`: the last hop inside the sandbox (after bwrap, or in `run`'s PID 1):
  lifeline, inode limits on the tmpfs mounts (bwrap cannot set them), capabilities reduced to
  the runner's set, no new privileges, every other descriptor closed, then exec ARGV (the
  runner) with a clean environment.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import stat
import sys

try:
    from tangram_celery.common.lifeline import arm, libc
except ImportError:  # run as a script from the staged boot directory
    from lifeline import arm, libc  # type: ignore[no-redef]

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS = 0x00020000, 0x02000000, 0x04000000
CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x08000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_MOVE, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 8192, 1 << 18, 1 << 21, 1 << 24
MNT_DETACH = 2
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 38, 47, 4
CAP_VERSION_3 = 0x20080522
CAPS = [
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "LINUX_IMMUTABLE",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_ADMIN",
    "NET_RAW",
    "IPC_LOCK",
    "IPC_OWNER",
    "SYS_MODULE",
    "SYS_RAWIO",
    "SYS_CHROOT",
    "SYS_PTRACE",
    "SYS_PACCT",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_NICE",
    "SYS_RESOURCE",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "MKNOD",
    "LEASE",
    "AUDIT_WRITE",
    "AUDIT_CONTROL",
    "SETFCAP",
    "MAC_OVERRIDE",
    "MAC_ADMIN",
    "SYSLOG",
    "WAKE_ALARM",
    "BLOCK_SUSPEND",
    "AUDIT_READ",
    "PERFMON",
    "BPF",
    "CHECKPOINT_RESTORE",
]
DEV_NODES = ("null", "zero", "full", "random", "urandom")
# read-only over our own /proc, as Docker does: the runner is uid 0 of the host's user namespace,
# and sysctls (kernel.core_pattern, ...) check little more than that
PROC_COVER = ("sys", "sysrq-trigger", "irq", "bus", "fs")
_SYSCALLS = {"x86_64": {"pivot_root": 155}, "aarch64": {"pivot_root": 41}}


class LaunchError(Exception):
    pass


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise LaunchError(f"{what}: {os.strerror(err)} (errno {err})")


def mount(src: str | None, dest: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def b(s: str | None) -> bytes | None:
        return None if s is None else s.encode()

    _check(libc().mount(b(src), b(dest), b(fstype), ctypes.c_ulong(flags), b(data)), f"mount {dest}")


def unshare(flags: int) -> None:
    _check(libc().unshare(flags), "unshare")


def pivot_root(new: str, old: str) -> None:
    fn = getattr(libc(), "pivot_root", None)
    if fn is not None:
        rc = fn(new.encode(), old.encode())
    else:  # glibc < 2.36 has no wrapper
        nr = _SYSCALLS.get(os.uname().machine, {}).get("pivot_root")
        if nr is None:
            raise LaunchError(f"pivot_root: unsupported architecture {os.uname().machine}")
        rc = libc().syscall(nr, new.encode(), old.encode())
    _check(rc, "pivot_root")


def cap_mask(names: list[str]) -> int:
    mask = 0
    for name in names:
        mask |= 1 << CAPS.index(name.upper().removeprefix("CAP_"))
    return mask


def drop_caps(keep: list[str]) -> None:
    """Bounding set, ambient, effective/permitted/inheritable all reduced to `keep`."""
    mask = cap_mask(keep)
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
    except OSError:
        last = len(CAPS) - 1
    for cap in range(last + 1):
        if not mask & (1 << cap):
            _check(libc().prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap}")
    libc().prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)  # EINVAL on old kernels: none
    header = (ctypes.c_uint32 * 2)(CAP_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)(mask & 0xFFFFFFFF, mask & 0xFFFFFFFF, 0, mask >> 32, mask >> 32, 0)
    _check(libc().capset(header, data), "capset")
    _check(libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def _flags_of(path: str) -> int:
    """The per-mount flags of the mount holding `path` (kept when we remount it)."""
    f = os.statvfs(path).f_flag
    out = 0
    for st_flag, ms_flag in (
        (os.ST_NOEXEC, MS_NOEXEC),
        (os.ST_NOATIME, MS_NOATIME),
        (os.ST_NODIRATIME, MS_NODIRATIME),
        (os.ST_RELATIME, MS_RELATIME),
    ):
        if f & st_flag:
            out |= ms_flag
    return out


def _mount_points_under(dest: str) -> list[str]:
    """Mount points at or below `dest` in this mount namespace (for recursive read-only)."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].encode().decode("unicode_escape")
            if mp == dest or mp.startswith(dest.rstrip("/") + "/"):
                out.append(mp)
    return sorted(set(out), key=len)


def bind(src: str, dest: str, readonly: bool, devices: bool = False) -> None:
    """Like bwrap's --ro-bind/--bind/--dev-bind: recursive bind, nosuid (and nodev unless a
    device), every submount read-only too when `readonly`."""
    mount(src, dest, None, MS_BIND | MS_REC)
    extra = MS_NOSUID | (0 if devices else MS_NODEV) | (MS_RDONLY if readonly else 0)
    for mp in _mount_points_under(dest):
        mount(None, mp, None, MS_BIND | MS_REMOUNT | extra | _flags_of(mp))


def _mkdir(path: str, mode: int = 0o755) -> None:
    os.makedirs(path, exist_ok=True)
    os.chmod(path, mode)


def _touch(path: str) -> None:
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o444))


def build_root(spec: dict) -> None:
    """In PID 1 of the new namespaces: the sandbox's file system, then pivot into it."""
    root = spec["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount reaches the host
    image = spec.get("overlay")
    if image:  # a container image's root file system under the trajectory's own upper layer
        data = f"lowerdir={image['lower']},upperdir={image['upper']},workdir={image['work']},metacopy=on"
        mount("overlay", root, "overlay", MS_NOSUID | MS_NODEV, data)
        if image.get("own"):  # a fresh layer: the workdir's tree becomes the sandbox user's
            own_tree(root + image["own"], int(image["uid"]))
    else:
        mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755")
    for target, path in spec.get("symlinks", []):
        _mkdir(os.path.dirname(root + path))
        if not (image and os.path.islink(root + path) and os.readlink(root + path) == target):
            os.symlink(target, root + path)  # (an image's kept layer has it from its last start)
    for src, dest in spec.get("host_binds", []):
        _mkdir(root + dest)
        bind(src, root + dest, readonly=True)
    _mkdir(root + "/proc")
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for sub in PROC_COVER:
        p = f"{root}/proc/{sub}"
        if os.path.exists(p):
            bind(p, p, readonly=True)
    dev = root + "/dev"
    _mkdir(dev)
    mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755")
    for node in DEV_NODES:
        _touch(f"{dev}/{node}")
        bind(f"/dev/{node}", f"{dev}/{node}", readonly=False, devices=True)
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", f"{dev}/{name}")
    os.symlink("/proc/self/fd", f"{dev}/fd")
    _mkdir(f"{dev}/shm")
    for dest, size_b, nr_inodes in spec.get("tmpfs", []):
        _mkdir(root + dest)
        mount(
            "tmpfs", root + dest, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755" + tmpfs_limits(size_b, nr_inodes)
        )
    for dest in spec.get("dirs", []):
        _mkdir(root + dest)
    for src, dest, readonly in spec.get("binds", []):
        _bind_into(root, src, dest, bool(readonly))
    os.chdir(root)
    try:
        pivot_root(".", ".")  # the old root ends up stacked under the new one: detach it
        _check(libc().umount2(b".", MNT_DETACH), "detach the old root")
    except LaunchError:
        # Docker's default seccomp profile forbids pivot_root even with CAP_SYS_ADMIN (a worker
        # in a container): move the new root over the old one and chroot into it, as
        # switch_root does. The old root stays mounted underneath, out of reach of a process
        # without CAP_SYS_CHROOT or CAP_SYS_ADMIN (the runner has neither) and of mountinfo.
        mount(".", "/", None, MS_MOVE)
        os.chroot(".")
    os.chdir("/")
    if not image:  # an image's root stays writable where its modes allow (the upper layer's quota)
        mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    hostname = spec.get("hostname", "sandbox").encode()
    _check(libc().sethostname(hostname, len(hostname)), "sethostname")


def _bind_into(root: str, src: str, dest: str, readonly: bool) -> None:
    if os.path.isdir(src):
        _mkdir(root + dest)
    else:  # a file (the resolv.conf of a sandbox with network), never through an image's links
        parent, want = os.path.dirname(root + dest), os.path.realpath(root) + os.path.dirname(dest)
        if os.path.lexists(parent) and os.path.realpath(parent) != want:
            raise LaunchError(f"{os.path.dirname(dest)} is a link in the sandbox's root")
        _mkdir(parent)
        if os.path.islink(root + dest):
            os.unlink(root + dest)
        _touch(root + dest)
    bind(src, root + dest, readonly=readonly)


def own_tree(top: str, uid: int) -> None:
    """`top` and everything below it owned by `uid` (links themselves, never followed): with
    overlayfs' metacopy, only the inodes' metadata is copied up, not the files' data."""
    if os.path.islink(top):
        raise LaunchError(f"the image's workdir {top!r} is a link")
    os.makedirs(top, mode=0o755, exist_ok=True)
    os.lchown(top, uid, uid)
    for d, dirs, files in os.walk(top):
        for name in dirs + files:
            path = os.path.join(d, name)
            st = os.lstat(path)
            # only what the image put there (root's): a file with another name elsewhere (a
            # hard link) or one a sandbox user already owns is left as it is
            if st.st_uid == 0 and (stat.S_ISDIR(st.st_mode) or st.st_nlink == 1):
                os.lchown(path, uid, uid)


def tmpfs_limits(size_b: int, nr_inodes: int) -> str:
    """`,size=...,nr_inodes=...` for a tmpfs mount's data (0 = no limit given)."""
    return (f",size={size_b}" if size_b else "") + (f",nr_inodes={nr_inodes}" if nr_inodes else "")


def finish(spec: dict, argv: list[str]) -> None:
    """The last step before the runner: limits bwrap cannot set, capabilities, exec."""
    if not arm(signal.SIGKILL, fd=spec.get("lifeline_fd")):
        os._exit(0)  # the worker is gone: nobody will ever talk to this sandbox
    for dest, size_b, nr_inodes in spec.get("remount", []):
        # a tmpfs remount changes only the options given; the mount flags must be restated
        mount(None, dest, None, MS_REMOUNT | MS_NOSUID | MS_NODEV, tmpfs_limits(size_b, nr_inodes)[1:])
    drop_caps(spec["caps"])
    os.closerange(3, 1 << 16)  # the lifeline and whatever else: the runner starts clean
    os.chdir(spec.get("cwd", "/"))
    os.execve(argv[0], argv, dict(spec.get("env") or {"PATH": "/usr/bin:/bin"}))


def join_cgroups(procs_files: list[str]) -> None:
    """Move this process into the sandbox's cgroups (before its cgroup namespace is made)."""
    for path in procs_files:
        with open(path, "w") as out:
            out.write(str(os.getpid()))  # read in the writer's pid namespace
    try:  # the runner must survive its own sandbox's OOM kills (user code raises its score)
        with open("/proc/self/oom_score_adj", "w") as adj:
            adj.write("-1000")
    except OSError:
        pass


def _child(spec: dict, argv: list[str], parent_r: int) -> None:
    """PID 1 of the new pid namespace (never returns)."""
    try:
        # Armed against the launcher, then checked: a launcher that died before this line has
        # closed the pipe's write end.
        if not arm(signal.SIGKILL, fd=parent_r):
            os._exit(0)
        os.umask(0o022)
        os.setsid()
        join_cgroups(spec.get("cgroup_procs", []))
        flags = CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
        if spec.get("netns"):  # the worker made it, linked to its egress router (egress.py)
            fd = os.open(spec["netns"], os.O_RDONLY | os.O_CLOEXEC)
            _check(libc().setns(fd, CLONE_NEWNET), "join the network namespace")
            os.close(fd)
        else:  # a fresh one: loopback only
            flags |= CLONE_NEWNET
        unshare(flags)
        build_root(spec)
        finish(spec, argv)
    except BaseException as e:
        print(f"tangram launcher (pid 1): {e}", file=sys.stderr, flush=True)
    os._exit(111)


def run(spec: dict, argv: list[str]) -> int:
    """Outer launcher: a new pid namespace and its PID 1, then wait for it.

    The launcher itself stays in the host's namespaces and outside the sandbox's cgroups (it
    costs the sandbox nothing); it exists to be PID 1's parent, so that PID 1 dies with it."""
    if not arm(signal.SIGKILL, fd=spec.get("lifeline_fd")):
        return 0
    unshare(CLONE_NEWPID)
    parent_r, parent_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(parent_w)
        _child(spec, argv, parent_r)
    os.close(parent_r)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGKILL))
    _, status = os.waitpid(pid, 0)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def main(args: list[str]) -> int:
    if len(args) < 2 or args[0] not in ("run", "finish"):
        print("usage: launcher.py run|finish SPEC [-- ARGV...]", file=sys.stderr)
        return 2
    mode, spec = args[0], json.loads(args[1])
    argv = args[3:] if args[2:3] == ["--"] else args[2:]
    try:
        if mode == "run":
            return run(spec, argv)
        finish(spec, argv)
    except (LaunchError, OSError) as e:
        print(f"tangram launcher ({mode}): {e}", file=sys.stderr, flush=True)
        return 111
    return 0  # pragma: no cover - finish execs


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
