"""A seccomp filter for user code, assembled here as classic BPF (stdlib only, no libseccomp).

In force in every user process and verifier before it runs anything of the user's, on both
backends (under Docker it stacks on the engine's profile): the zygote installs it on itself at
start, and every process it forks inherits it (across exec too).
It refuses what a sandboxed program has no use for and what widens the kernel's attack surface:
new namespaces (a child of `unshare -Ur` would be uid 0 with every capability in its own user
namespace), mounts, ptrace and cross-process memory access, kernel keyrings, eBPF, perf,
userfaultfd, io_uring, module and kexec loading, clock and host settings. Comparable to Docker's
default profile for an unprivileged process; unlike it, allow-by-default with a deny list, so a
new harmless syscall keeps working on a newer kernel.

Refused calls fail with EPERM (the program sees an ordinary error), except `clone3`, which fails
with ENOSYS: its flags live in memory a filter cannot read, and on ENOSYS libc falls back to
`clone`, whose flags are checked. A foreign calling convention (i386 `int 0x80`, x32) gets ENOSYS.
"""

from __future__ import annotations

import struct

# seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6] (little-endian targets)
_OFF_NR, _OFF_ARCH, _OFF_ARG0_LO = 0, 4, 16
AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_AARCH64 = 0xC00000B7
X32_SYSCALL_BIT = 0x40000000

RET_ALLOW = 0x7FFF0000
RET_ERRNO = 0x00050000
EPERM, ENOSYS = 1, 38

# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET. (CLONE_NEWTIME, 0x80,
# shares its bit with the exit signal in clone(); the kernel accepts it only from clone3/unshare.)
CLONE_NEW_MASK = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
AF_VSOCK = 40

DENIED = (
    # namespaces and mounts
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "mount_setattr",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    # other processes' memory and descriptors
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "process_madvise",
    "pidfd_getfd",
    "kcmp",
    "move_pages",
    "migrate_pages",
    # kernel attack surface a test never needs
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "open_by_handle_at",
    "lookup_dcookie",
    "fanotify_init",
    # IPC objects that outlive their process in the sandbox's IPC namespace (a channel to the
    # sandbox's next occupant, which the scrub could not see or remove: docs/sandbox.md)
    "shmget",
    "semget",
    "msgget",
    "mq_open",
    # the host itself
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "swapon",
    "swapoff",
    "reboot",
    "acct",
    "syslog",
    "vhangup",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "sethostname",
    "setdomainname",
    "quotactl",
    "quotactl_fd",
    "nfsservctl",
    # x86_64 only (absent on aarch64)
    "iopl",
    "ioperm",
    "uselib",
    "_sysctl",
    "sysfs",
    "ustat",
    "create_module",
    "get_kernel_syms",
    "query_module",
    "vserver",
    "afs_syscall",
)

# syscall numbers (x86_64: asm/unistd_64.h; aarch64: asm-generic/unistd.h); a unit test checks
# them against the headers when those are installed
SYSCALLS: dict[int, dict[str, int]] = {
    AUDIT_ARCH_X86_64: {
        "socket": 41,
        "clone": 56,
        "ptrace": 101,
        "syslog": 103,
        "uselib": 134,
        "ustat": 136,
        "sysfs": 139,
        "vhangup": 153,
        "pivot_root": 155,
        "_sysctl": 156,
        "chroot": 161,
        "acct": 163,
        "settimeofday": 164,
        "mount": 165,
        "umount2": 166,
        "swapon": 167,
        "swapoff": 168,
        "reboot": 169,
        "sethostname": 170,
        "setdomainname": 171,
        "iopl": 172,
        "ioperm": 173,
        "create_module": 174,
        "init_module": 175,
        "delete_module": 176,
        "get_kernel_syms": 177,
        "query_module": 178,
        "quotactl": 179,
        "nfsservctl": 180,
        "afs_syscall": 183,
        "lookup_dcookie": 212,
        "clock_settime": 227,
        "vserver": 236,
        "kexec_load": 246,
        "add_key": 248,
        "request_key": 249,
        "keyctl": 250,
        "migrate_pages": 256,
        "unshare": 272,
        "move_pages": 279,
        "perf_event_open": 298,
        "fanotify_init": 300,
        "open_by_handle_at": 304,
        "clock_adjtime": 305,
        "setns": 308,
        "process_vm_readv": 310,
        "process_vm_writev": 311,
        "kcmp": 312,
        "finit_module": 313,
        "kexec_file_load": 320,
        "bpf": 321,
        "userfaultfd": 323,
        "shmget": 29,
        "semget": 64,
        "msgget": 68,
        "mq_open": 240,
        "io_uring_setup": 425,
        "io_uring_enter": 426,
        "io_uring_register": 427,
        "open_tree": 428,
        "move_mount": 429,
        "fsopen": 430,
        "fsconfig": 431,
        "fsmount": 432,
        "fspick": 433,
        "clone3": 435,
        "pidfd_getfd": 438,
        "process_madvise": 440,
        "mount_setattr": 442,
        "quotactl_fd": 443,
    },
    AUDIT_ARCH_AARCH64: {
        "lookup_dcookie": 18,
        "umount2": 39,
        "mount": 40,
        "pivot_root": 41,
        "nfsservctl": 42,
        "chroot": 51,
        "vhangup": 58,
        "quotactl": 60,
        "acct": 89,
        "unshare": 97,
        "kexec_load": 104,
        "init_module": 105,
        "delete_module": 106,
        "clock_settime": 112,
        "syslog": 116,
        "ptrace": 117,
        "reboot": 142,
        "sethostname": 161,
        "setdomainname": 162,
        "settimeofday": 170,
        "socket": 198,
        "add_key": 217,
        "request_key": 218,
        "keyctl": 219,
        "clone": 220,
        "swapon": 224,
        "swapoff": 225,
        "migrate_pages": 238,
        "move_pages": 239,
        "perf_event_open": 241,
        "fanotify_init": 262,
        "open_by_handle_at": 265,
        "clock_adjtime": 266,
        "setns": 268,
        "process_vm_readv": 270,
        "process_vm_writev": 271,
        "kcmp": 272,
        "finit_module": 273,
        "bpf": 280,
        "userfaultfd": 282,
        "shmget": 194,
        "semget": 190,
        "msgget": 186,
        "mq_open": 180,
        "kexec_file_load": 294,
        "io_uring_setup": 425,
        "io_uring_enter": 426,
        "io_uring_register": 427,
        "open_tree": 428,
        "move_mount": 429,
        "fsopen": 430,
        "fsconfig": 431,
        "fsmount": 432,
        "fspick": 433,
        "clone3": 435,
        "pidfd_getfd": 438,
        "process_madvise": 440,
        "mount_setattr": 442,
        "quotactl_fd": 443,
    },
}

# classic BPF opcodes
_LD_W_ABS = 0x20
_JMP_JA = 0x05
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06


class _Asm:
    """A tiny assembler: conditional jumps name labels, resolved to 8-bit forward offsets."""

    def __init__(self) -> None:
        self.code: list[tuple[int, str | int, str | int, int]] = []
        self.labels: dict[str, int] = {}

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def op(self, code: int, k: int, jt: str | int = 0, jf: str | int = 0) -> None:
        self.code.append((code, jt, jf, k))

    def assemble(self) -> bytes:
        out = bytearray()
        for pc, (code, jt, jf, k) in enumerate(self.code):
            offs = []
            for j in (jt, jf):
                off = j if isinstance(j, int) else self.labels[j] - pc - 1
                if not 0 <= off <= 255:
                    raise ValueError(f"jump at {pc} out of range ({off})")
                offs.append(off)
            out += struct.pack("=HBBI", code, offs[0], offs[1], k)
        return bytes(out)


def build_filter() -> bytes:
    """The filter program (sock_filter array) for x86_64 and aarch64."""
    a = _Asm()
    a.op(_LD_W_ABS, _OFF_ARCH)
    a.op(_JEQ_K, AUDIT_ARCH_X86_64, "x86_64", 0)
    a.op(_JEQ_K, AUDIT_ARCH_AARCH64, "aarch64", "enosys")
    for arch, name in ((AUDIT_ARCH_X86_64, "x86_64"), (AUDIT_ARCH_AARCH64, "aarch64")):
        nrs = SYSCALLS[arch]
        a.label(name)
        a.op(_LD_W_ABS, _OFF_NR)
        if arch == AUDIT_ARCH_X86_64:
            a.op(_JGE_K, X32_SYSCALL_BIT, "enosys", 0)
        a.op(_JEQ_K, nrs["clone"], "clone_flags", 0)
        a.op(_JEQ_K, nrs["socket"], "socket_family", 0)
        a.op(_JEQ_K, nrs["clone3"], "enosys", 0)
        for sc in DENIED:
            if sc in nrs:
                a.op(_JEQ_K, nrs[sc], "eperm", 0)
        a.op(_RET_K, RET_ALLOW)
    # clone(flags, ...) and socket(family, ...) take the checked value as the first argument on
    # both architectures
    a.label("clone_flags")
    a.op(_LD_W_ABS, _OFF_ARG0_LO)
    a.op(_JSET_K, CLONE_NEW_MASK, "eperm", 0)
    a.op(_RET_K, RET_ALLOW)
    a.label("socket_family")
    a.op(_LD_W_ABS, _OFF_ARG0_LO)
    a.op(_JEQ_K, AF_VSOCK, "eperm", 0)
    a.op(_RET_K, RET_ALLOW)
    a.label("eperm")
    a.op(_RET_K, RET_ERRNO | EPERM)
    a.label("enosys")
    a.op(_RET_K, RET_ERRNO | ENOSYS)
    return a.assemble()


_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2


_prepared: list[object] = []
_state = {"installed": False}  # a fork inherits it with the filter itself


def prepare() -> None:
    """Load ctypes and assemble the filter now (the zygote does this once, before forking)."""
    if _prepared:
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    prctl = libc.prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = build_filter()
    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = SockFprog(len(prog) // 8, ctypes.addressof(buf))
    # prctl again, without argument types, for the calls of a fresh fork (`set_name`,
    # `set_pdeathsig`: an int and a name or ints, which ctypes passes as they are): converting
    # five arguments by their types writes some 25 pages shared with the parent, this none
    raw = libc["prctl"]  # a function object of its own, not the one with argtypes
    _prepared.extend([prctl, ctypes.get_errno, buf, fprog, ctypes.addressof(fprog), raw])


def installed() -> bool:
    """Did this process, or the process it was forked from, install the filter?"""
    return _state["installed"]


def set_name(name: bytes) -> None:
    """This process's name in ps and /proc/<pid>/comm (at most 15 bytes)."""
    prepare()
    prctl = _prepared[5]
    prctl(_PR_SET_NAME, name[:15], 0, 0, 0)  # type: ignore[operator]


def set_pdeathsig() -> None:
    """SIGKILL this process when its parent (the thread that forked it) exits."""
    prepare()
    prctl = _prepared[5]
    prctl(_PR_SET_PDEATHSIG, 9, 0, 0, 0)  # type: ignore[operator]


def install() -> None:
    """PR_SET_NO_NEW_PRIVS (setuid binaries stay unprivileged), then the filter, in this thread
    (call it single-threaded, after dropping privileges). Raises OSError."""
    prepare()
    prctl, get_errno, _buf, _fprog, addr, _raw = _prepared
    if prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:  # type: ignore[operator]
        err = get_errno()  # type: ignore[operator]
        raise OSError(err, f"PR_SET_NO_NEW_PRIVS failed: errno {err}")
    if prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, addr, 0, 0) != 0:  # type: ignore[operator]
        err = get_errno()  # type: ignore[operator]
        raise OSError(err, f"seccomp filter refused: errno {err}")
    _state["installed"] = True
