"""The languages the runner runs (stdlib only): the file a program is written to, its compile
command (a phase of its own, under its own time limit, writing into a fresh build directory) and
the command that runs it.

Toolchain paths come from the host in `RunRequest.tools`, resolved there: /usr/bin/java,
/usr/bin/cc and friends are links through /etc/alternatives, which the sandbox does not have. Every flag
that changes what is built is part of `compile_argv`, so it is part of the build cache's key.

Per-language choices, and why:
- java: `-proc:none` (javac would otherwise run annotation processors found on the class path,
  i.e. user code, at compile time), the JVM sized to the action's memory (`-XX:MaxRAM`: without
  the host's cgroup files in the sandbox it would size its heap from the host's RAM), the serial
  collector (one GC thread, not one per core), no hsperfdata files in /tmp.
- go: GOPATH mode (no module downloads: the sandbox has no network), cgo off (no C toolchain
  run from user source), no go env file (`GOENV=off`: it lives under $HOME, the workdir, where
  user code could set `-toolexec`), the build cache inside the build directory (a cache shared across
  actions could be poisoned by user code to make a later build produce another program).
- rust: the linker named by its real path (rustc's default `cc` is an /etc/alternatives link),
  std's debug info stripped (it would fill most of a small /tmp quota per build).
- nodejs: no compile phase; the V8 heap is capped below the action's memory so that running out
  of heap is an error V8 reports rather than an OOM kill.
"""

from __future__ import annotations

import re

# language -> the file its code is written to (java: the public class's name, see `unit`)
UNITS = {
    "python": "main.py",
    "bash": "main.sh",
    "c": "main.c",
    "cpp": "main.cpp",
    "nodejs": "main.js",
    "go": "main.go",
    "java": "Main.java",
    "rust": "main.rs",
}
COMPILED = frozenset({"c", "cpp", "go", "java", "rust"})
BINARY = "main"  # the executable a native compile leaves in the build directory
_JAVA_PUBLIC = re.compile(
    r"^\s*public\s+(?:(?:final|abstract|strictfp)\s+)*(?:class|record|enum|interface)\s+([A-Za-z_$][\w$]*)",
    re.M,
)


def java_class(code: str | None) -> str:
    """The class a Java program's `main` lives in: its public top-level class, else Main (javac
    insists that a public class live in a file of its name)."""
    m = _JAVA_PUBLIC.search(code or "")
    return m.group(1) if m else "Main"


def unit(lang: str, code: str | None) -> str:
    """The workdir file the code of `lang` is written to."""
    if lang == "java":
        return java_class(code) + ".java"
    return UNITS[lang]


def _jvm_flags(memory_mb: int) -> list[str]:
    return ["-XX:+UseSerialGC", "-XX:-UsePerfData", "-Xshare:auto", f"-XX:MaxRAM={max(64, memory_mb)}m"]


def compile_argv(lang: str, tools: dict[str, str], src: str, build: str, memory_mb: int) -> list[str]:
    """The compiler command: source `src` (relative to the workdir, the compiler's cwd) into the
    directory `build`."""
    out = f"{build}/{BINARY}"
    if lang == "c":
        return [tools["gcc"], "-O2", "-pipe", "-o", out, src, "-lm"]
    if lang == "cpp":
        return [tools["g++"], "-O2", "-pipe", "-std=gnu++17", "-o", out, src, "-lm"]
    if lang == "go":
        return [tools["go"], "build", "-o", out, src]
    if lang == "rust":
        strip = ["-C", "strip=debuginfo"]  # std's debug info: 11 MiB of a 0.4 MiB program
        return [
            tools["rustc"],
            "--edition",
            "2021",
            "-O",
            *strip,
            "-C",
            f"linker={tools['gcc']}",
            "-o",
            out,
            src,
        ]
    if lang == "java":
        jflags = ["-J" + f for f in _jvm_flags(memory_mb)] + ["-J-XX:TieredStopAtLevel=1"]
        return [tools["javac"], *jflags, "-proc:none", "-encoding", "UTF-8", "-d", build, src]
    raise ValueError(f"{lang} has no compile phase")


def compile_env(lang: str, build: str) -> dict[str, str]:
    if lang == "go":
        return {
            "GOCACHE": f"{build}/.gocache",
            "GOPATH": f"{build}/.gopath",
            "GO111MODULE": "off",
            # not $HOME/.config/go/env: HOME is the workdir, and a GOFLAGS=-toolexec=... that an
            # earlier action wrote there would run user code inside the compile
            "GOENV": "off",
            "CGO_ENABLED": "0",
            "GOFLAGS": "",
            "GOTELEMETRY": "off",
        }
    return {}


def scratch(lang: str) -> list[str]:
    """Build-directory entries that are the compiler's scratch, removed before the build is kept."""
    return [".gocache", ".gopath"] if lang == "go" else []


def run_argv(
    lang: str,
    tools: dict[str, str],
    build: str | None,
    src: str,
    memory_mb: int,
    interpreter: str | None = None,
) -> list[str] | None:
    """The command that runs a program (None: python, which the zygote runs itself, unless an
    `interpreter` of the sandbox's image is to run it: `RunRequest.interpreter`)."""
    if lang == "python":
        return [interpreter, "-s", src] if interpreter else None
    if lang == "bash":
        return [tools.get("bash", "/bin/bash"), src]
    if lang == "nodejs":
        heap_mb = max(16, memory_mb * 3 // 4)
        return [tools["node"], f"--max-old-space-size={heap_mb}", src]
    assert build is not None, f"{lang} runs what its compile phase built"
    if lang == "java":
        return [tools["java"], *_jvm_flags(memory_mb), "-cp", build, java_class_of(src)]
    return [f"{build}/{BINARY}"]


def java_class_of(src: str) -> str:
    return src.rsplit("/", 1)[-1].removesuffix(".java")
