"""`image_root`'s pure parts: the ELF loader a program names, the command that runs the host's
python3 from under HOST_DIR, the host mounts, and the image's tools found in a root filesystem."""

from __future__ import annotations

import os
import struct
import subprocess
from pathlib import Path

import pytest

from tangram_celery.common.errors import SandboxError
from tangram_celery.sandbox.image_root import (
    HOST_DIR,
    elf_interpreter,
    host_mounts,
    host_python_argv,
    interpreter_in,
    spill_name,
    tools_in,
)
from tangram_celery.sandbox.limits import HOST_RO_PATHS, SANDBOX_PYTHON


def test_elf_interpreter_of_the_hosts_python_is_its_loader() -> None:
    """/usr/bin/python3 names the host's dynamic loader (the one `ldd` shows), an existing file."""
    loader = elf_interpreter(SANDBOX_PYTHON)
    assert loader.startswith("/") and os.path.exists(loader) and "ld-" in os.path.basename(loader)
    ldd = subprocess.run(["ldd", SANDBOX_PYTHON], capture_output=True, text=True, check=True).stdout
    assert loader in ldd


def _elf(tmp_path: Path, klass: int = 2, phnum: int = 0) -> Path:
    """A 64-bit little-endian ELF header with `phnum` empty program headers right after it."""
    head = bytearray(64)
    head[:6] = b"\x7fELF" + bytes([klass, 1])
    head[32:40] = struct.pack("<Q", 64)  # e_phoff
    head[54:58] = struct.pack("<HH", 56, phnum)  # e_phentsize, e_phnum
    path = tmp_path / "prog"
    path.write_bytes(bytes(head) + bytes(56 * phnum))
    return path


def test_elf_interpreter_refuses_what_names_no_loader(tmp_path: Path) -> None:
    """A script, a 32-bit ELF and a (static-like) ELF without PT_INTERP each raise SandboxError."""
    script = tmp_path / "script"
    script.write_text("#!/bin/sh\necho hi\n" + " " * 64)
    with pytest.raises(SandboxError, match="not a 64-bit ELF"):
        elf_interpreter(str(script))
    with pytest.raises(SandboxError, match="not a 64-bit ELF"):
        elf_interpreter(str(_elf(tmp_path, klass=1)))
    with pytest.raises(SandboxError, match="no program interpreter"):
        elf_interpreter(str(_elf(tmp_path, phnum=2)))


def test_host_python_argv_runs_the_hosts_python_through_its_loader() -> None:
    """The command is (loader, --library-path, dirs, python), every path under HOST_DIR and real
    on the host; with HOST_DIR taken off, it runs the host's python3."""
    argv = host_python_argv()
    assert len(argv) == 4 and argv[1] == "--library-path"
    loader, libs, python = argv[0], argv[2].split(":"), argv[3]
    for p in (loader, python, *libs):
        assert p.startswith(HOST_DIR + "/"), p
    host = [p.removeprefix(HOST_DIR) for p in (loader, python)]
    assert host[0] == os.path.realpath(elf_interpreter(SANDBOX_PYTHON))
    assert host[1] == os.path.realpath(SANDBOX_PYTHON) and not os.path.islink(host[1])
    dirs = [d.removeprefix(HOST_DIR) for d in libs]
    assert all(os.path.isdir(d) and os.path.realpath(d) == d for d in dirs) and len(set(dirs)) == len(dirs)
    done = subprocess.run(
        [host[0], "--library-path", ":".join(dirs), host[1], "-c", "import sys; print(sys.version_info[0])"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout == "3\n"


def test_host_mounts_cover_the_system_dirs_under_host_dir() -> None:
    """Each of /usr, /lib, /lib64, /bin, /sbin that the host has is a bind (a directory) or a link
    (a usr-merged host's /lib -> usr/lib) under HOST_DIR, never both."""
    links, binds = host_mounts()
    linked = {path.removeprefix(HOST_DIR) for _, path in links}
    bound = {src for src, _ in binds}
    assert not linked & bound and "/usr" in bound
    assert linked | bound == {p for p in HOST_RO_PATHS if os.path.isdir(p)}
    assert all(dst == HOST_DIR + src for src, dst in binds)
    assert all(target == os.readlink(path.removeprefix(HOST_DIR)) for target, path in links)


def _exe(path: Path, mode: int = 0o755) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(mode)


@pytest.fixture
def rootfs(tmp_path: Path) -> Path:
    """A fake usr-merged image: bash, python3 -> python3.11, gcc not executable, node through an
    absolute link, java linked out of the root (which stays inside it: absent)."""
    root = tmp_path / "rootfs"
    _exe(root / "usr/bin/bash")
    _exe(root / "usr/bin/python3.11")
    (root / "usr/bin/python3").symlink_to("python3.11")
    _exe(root / "usr/bin/gcc", mode=0o644)
    _exe(root / "opt/node/bin/node")
    (root / "usr/local/bin").mkdir(parents=True)
    (root / "usr/local/bin/node").symlink_to("/opt/node/bin/node")
    (root / "usr/bin/java").symlink_to("../../../../../../../../usr/bin/python3")
    (root / "bin").symlink_to("usr/bin")
    return root


def test_tools_in_resolves_within_the_image(rootfs: Path) -> None:
    assert tools_in(rootfs, "bash") == {"bash": "/usr/bin/bash"}
    assert tools_in(rootfs, "python") == {"python3": "/usr/bin/python3.11"}
    assert tools_in(rootfs, "c") == {}  # not executable: left out (the runner says which)
    assert tools_in(rootfs, "nodejs") == {"node": "/opt/node/bin/node"}
    java = tools_in(rootfs, "java")  # ../.. stops at the image's root: its own /usr/bin/python3
    assert java == {"java": "/usr/bin/python3.11"}
    # the interpreter by the name the image's PATH finds (a venv's python is a link that must keep it)
    assert interpreter_in(rootfs) == "/usr/local/bin/python3" or interpreter_in(rootfs) == "/usr/bin/python3"


def test_interpreter_in_falls_back_to_python_and_may_be_none(tmp_path: Path) -> None:
    root = tmp_path / "r"
    (root / "usr/bin").mkdir(parents=True)
    assert interpreter_in(root) is None and tools_in(root, "python") == {}
    _exe(root / "usr/bin/python")
    assert interpreter_in(root) == "/usr/bin/python"


def test_spill_names_are_fixed_per_trajectory() -> None:
    a, b = spill_name("t/1"), spill_name("../t 2")
    assert a == spill_name("t/1") and a != b
    assert all(n.endswith(".tar") and "/" not in n and len(n) == 44 for n in (a, b))
