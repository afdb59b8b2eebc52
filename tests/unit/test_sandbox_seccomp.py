"""The seccomp filter for user code: syscall numbers, the assembled BPF program's decisions (run
in a small classic-BPF interpreter here), and the filter installed in a real child process."""

from __future__ import annotations

import ctypes
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tangram_runner import seccomp as sc

X86, ARM = sc.AUDIT_ARCH_X86_64, sc.AUDIT_ARCH_AARCH64
ALLOW, EPERM, ENOSYS = sc.RET_ALLOW, sc.RET_ERRNO | sc.EPERM, sc.RET_ERRNO | sc.ENOSYS
HEADERS = {
    X86: Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
    ARM: Path("/usr/include/asm-generic/unistd.h"),
}


def run_bpf(prog: bytes, arch: int, nr: int, arg0: int = 0) -> int:
    """Evaluate a classic-BPF seccomp program on one seccomp_data."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    insns = [struct.unpack("=HBBI", prog[i : i + 8]) for i in range(0, len(prog), 8)]
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:  # ld w abs
            acc = struct.unpack_from("<I", data, k)[0]
            pc += 1
        elif code == 0x06:  # ret k
            return k
        elif code == 0x05:  # ja
            pc += 1 + k
        else:
            cond = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += 1 + (jt if cond else jf)


def header_numbers(path: Path) -> dict[str, int]:
    text = path.read_text()
    return {m[1]: int(m[2]) for m in re.finditer(r"#define __NR(?:3264)?_(\w+)\s+(\d+)\b", text)}


@pytest.mark.parametrize("arch", [X86, ARM])
def test_syscall_numbers_match_the_kernel_headers(arch: int) -> None:
    """Given the installed kernel headers, when compared, then every number in the table agrees."""
    if not HEADERS[arch].exists():
        pytest.skip(f"{HEADERS[arch]} not installed (linux-libc-dev)")
    nums = header_numbers(HEADERS[arch])
    assert {name: nums.get(name) for name in sc.SYSCALLS[arch]} == sc.SYSCALLS[arch]
    missing = [n for n in sc.DENIED if n not in sc.SYSCALLS[arch] and n in nums]
    assert not missing, f"denied syscalls without a number for this arch: {missing}"


@pytest.mark.parametrize("arch", [X86, ARM])
def test_filter_denies_namespaces_tracing_and_kernel_surface(arch: int) -> None:
    """Given the filter, when evaluated per architecture, then namespace, mount, ptrace, bpf, ...
    get EPERM, clone3 ENOSYS (libc falls back to clone), clone with CLONE_NEW* flags EPERM, and
    ordinary calls (read, a plain clone/fork, an inet socket) are allowed."""
    prog = sc.build_filter()
    nrs = sc.SYSCALLS[arch]
    for name in sc.DENIED:
        if name in nrs:
            assert run_bpf(prog, arch, nrs[name]) == EPERM, name
    assert run_bpf(prog, arch, nrs["clone3"]) == ENOSYS
    plain_fork = 0x01200011  # CLONE_CHILD_SETTID | CLONE_CHILD_CLEARTID | SIGCHLD
    assert run_bpf(prog, arch, nrs["clone"], plain_fork) == ALLOW
    for flag in (0x10000000, 0x20000000, 0x00020000, 0x40000000, 0x04000000, 0x08000000, 0x02000000):
        assert run_bpf(prog, arch, nrs["clone"], plain_fork | flag) == EPERM, hex(flag)
    assert run_bpf(prog, arch, nrs["socket"], 2) == ALLOW
    assert run_bpf(prog, arch, nrs["socket"], sc.AF_VSOCK) == EPERM
    read_nr = 0 if arch == X86 else 63
    assert run_bpf(prog, arch, read_nr) == ALLOW


def test_foreign_calling_conventions_are_refused() -> None:
    """Given x32 syscall numbers or another architecture (i386 via int 0x80), then ENOSYS."""
    prog = sc.build_filter()
    assert run_bpf(prog, X86, 0x40000000 | 272) == ENOSYS
    assert run_bpf(prog, 0x40000003, 310) == ENOSYS  # AUDIT_ARCH_I386, unshare there


CHILD = """
import ctypes, os, subprocess, sys
sys.path.insert(0, sys.argv[1])
from tangram_runner import seccomp as sc
os.setgroups([]); os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)
sc.install()
libc = ctypes.CDLL(None, use_errno=True)
def err(r):
    return ctypes.get_errno() if r == -1 else 0
print("unshare", err(libc.unshare(0x10000000)))
print("clone3", err(libc.syscall(435 if os.uname().machine in ("x86_64", "aarch64") else -1, 0, 0)))
r = subprocess.run(["unshare", "-Ur", "id", "-u"], capture_output=True, text=True)
print("unshare-cmd", r.returncode, r.stdout.strip() or "-")
print("subprocess", subprocess.run(["id", "-u"], capture_output=True, text=True).stdout.strip())
"""


@pytest.mark.skipif(os.getuid() != 0, reason="the child drops to nobody, which needs root")
def test_installed_filter_blocks_user_namespaces_in_a_real_child() -> None:
    """Given a child that dropped privileges and installed the filter, when it tries to unshare
    a user namespace (directly and via `unshare -Ur`), then it fails and never becomes uid 0;
    forking and exec'ing still work."""
    root = Path(sc.__file__).parent.parent
    out = subprocess.run(
        ["/usr/bin/python3", "-c", CHILD, str(root)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["unshare"] == "1"  # EPERM
    assert lines["clone3"] == "38"  # ENOSYS
    assert lines["unshare-cmd"].split()[0] != "0" and lines["unshare-cmd"].split()[1] != "0"
    assert lines["subprocess"] == "65534"


def test_filter_fits_classic_bpf_limits() -> None:
    """Given the filter, then it is a whole number of instructions under the kernel's 4096."""
    prog = sc.build_filter()
    assert len(prog) % 8 == 0 and len(prog) // 8 < 4096
    assert sys.byteorder == "little"  # the filter reads the low half of arg0 at offset 16
    assert ctypes.sizeof(ctypes.c_ulong) == 8
