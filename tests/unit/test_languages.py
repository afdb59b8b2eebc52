"""Pure parts of the sandbox languages: names, units, toolchain resolution, the build cache key,
and the submit-time refusal of a language no CPU node offers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tangram_celery.common.actions import COMPILED_LANGUAGES, LANGUAGES, CodeAction
from tangram_celery.common.config import parse_config
from tangram_celery.common.wire import ActionMeta, PoolView
from tangram_celery.sandbox import languages
from tangram_celery.store.client_ops import languages_of
from tangram_runner import build, langs


def test_runner_and_host_agree_on_the_languages() -> None:
    """Every language has a unit file and host tools, and both sides agree on which compile."""
    assert set(langs.UNITS) == set(LANGUAGES) == set(languages.TOOLS)
    assert langs.COMPILED == COMPILED_LANGUAGES
    assert {"cpp", "nodejs", "go", "java", "rust"} <= set(LANGUAGES)  # SandboxFusion's names


def test_java_source_is_named_after_its_public_class() -> None:
    """A public class Words goes to Words.java and runs as Words; without one, Main."""
    code = "import java.util.*;\n\npublic final class Words { public static void main(String[] a) {} }"
    assert langs.unit("java", code) == "Words.java"
    assert langs.unit("java", "class Helper {}\nclass Main {}") == "Main.java"
    argv = langs.run_argv("java", {"java": "/j/java"}, "/tmp/b", "Words.java", 256)
    assert argv is not None and argv[-3:] == ["-cp", "/tmp/b", "Words"] and "-XX:MaxRAM=256m" in argv


def test_compile_commands_keep_user_code_out_of_the_compile() -> None:
    """javac runs no annotation processors; go builds offline without cgo and a shared cache."""
    tools = {"javac": "/j/javac", "go": "/g/go", "rustc": "/r/rustc", "gcc": "/usr/bin/gcc-12"}
    assert "-proc:none" in langs.compile_argv("java", tools, "Main.java", "/b", 512)
    env = langs.compile_env("go", "/b")
    assert env["GO111MODULE"] == "off" and env["CGO_ENABLED"] == "0" and env["GOCACHE"].startswith("/b/")
    assert env["GOENV"] == "off"  # a go env file in $HOME (the workdir) could set -toolexec
    assert "linker=/usr/bin/gcc-12" in langs.compile_argv("rust", tools, "main.rs", "/b", 512)
    with pytest.raises(ValueError):
        langs.compile_argv("nodejs", tools, "main.js", "/b", 512)


def test_a_tool_outside_the_sandbox_paths_does_not_count(tmp_path: Path) -> None:
    """A toolchain in a home directory (~/.cargo/bin) is not one a sandbox can run."""
    exe = tmp_path / "rustc"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert languages.resolve(str(exe)) is None
    assert languages.resolve("/bin/sh") is not None  # resolved through links, under /usr
    assert languages.available(["python"]) in ([], ["python"])


def test_the_build_key_changes_with_any_file_a_compile_could_read(tmp_path: Path) -> None:
    """Same command and files: same key; a changed header or flag: another key."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "main.cpp").write_text('#include "k.h"\n')
    (work / "k.h").write_text("#define K 1\n")
    argv = ["/usr/bin/g++", "-O2", "-o", "@BUILD/main", "main.cpp"]
    first = build.key("cpp", argv, {}, (str(work),))
    assert first is not None and first == build.key("cpp", argv, {}, (str(work),))
    (work / "k.h").write_text("#define K 2\n")
    assert build.key("cpp", argv, {}, (str(work),)) != first
    assert build.key("cpp", [*argv, "-DX"], {}, (str(work),)) != build.key("cpp", argv, {}, (str(work),))
    os.symlink("/etc/passwd", work / "link")
    assert build.key("cpp", argv, {}, (str(work),)) is not None  # links are hashed, not followed


def test_a_held_build_outlives_its_compile_request_and_not_its_run(tmp_path: Path) -> None:
    """Given an uncached build held by its compile request, then it survives the end of that
    request, is handed to the run request of its action only, and is removed after that one;
    a build held by an action whose run never came goes with the next request."""
    first, second = tmp_path / "b1", tmp_path / "b2"
    for d in (first, second):
        d.mkdir()
        build._made.append(str(d))
    build.hold("a1", str(first))
    build.end_action()  # the compile request ends
    assert first.is_dir() and build.take_held("other") is None
    assert build.take_held("a1") == str(first)
    build.end_action()  # the run request ends: the uncached build goes
    assert not first.exists()
    build.hold("a2", str(second))
    build.end_action()
    build._made.append(str(tmp_path / "b3"))
    build.hold("a3", str(tmp_path / "b3"))  # a2's run never came
    build.end_action()
    assert not second.exists() and build.take_held("a2") is None
    assert build.take_held("a3") is not None
    build.end_action()


def test_a_compiled_action_reserves_its_compile_phase_memory() -> None:
    """Given the compile phase's floor of 512 MiB, then a C++ action of 64 MiB reserves 512 on
    its node (its compiler runs there under 512), Python keeps 64, and the floor never exceeds
    the largest node."""
    from scheduler.service.cluster import to_queued

    def reserved(language: str, memory_mb: int, node_mb: int = 4096) -> int:
        cfg = parse_config({"nodes": {"cpu": [{"name": "n", "cores": 2, "memory_mb": node_mb}]}})
        a = CodeAction(trajectory_id="t", language=language, code="x", memory_mb=memory_mb)
        return to_queued(ActionMeta.of(a, 0.0), cfg).cost.memory_mb

    assert reserved("cpp", 64) == 512 and reserved("rust", 1024) == 1024
    assert reserved("python", 64) == 64
    assert reserved("go", 64, node_mb=256) == 256


def test_an_unoffered_language_is_refused_by_the_pool_view() -> None:
    """Once workers reported, a code action in another language is refused with the list."""
    view = PoolView.of(parse_config({"nodes": {"cpu": [{"name": "n0", "cores": 2, "memory_mb": 4096}]}}))
    meta = ActionMeta.of(CodeAction(language="rust", code="fn main(){}"), 0.0)
    assert view.refusal(meta) is None  # nobody reported yet: not checked
    reported = view.with_languages(languages_of({b"n0": b'["python", "cpp"]', "bad": "{"}))
    assert reported.languages == ["cpp", "python"]
    why = reported.refusal(meta)
    assert why is not None and "'rust' is not available" in why and "cpp, python" in why
    ok = ActionMeta.of(CodeAction(language="cpp", code="int main(){}"), 0.0)
    assert reported.refusal(ok) is None
    assert ActionMeta.model_validate_json(meta.dumps()).language == "rust"
