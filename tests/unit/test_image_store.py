"""The per-node image store: OCI layouts written and read, layers unpacked safely, refcounts,
least-recently-used eviction, the disk budget, restarts, and paths resolved inside an image."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import stat
import tarfile
import threading
from pathlib import Path
from typing import Any

import pytest

from tangram_celery.common.config import SandboxConfig
from tangram_celery.common.config_images import ImagesConfig
from tangram_celery.sandbox.image_store import (
    ImageCorrupt,
    ImageNotFound,
    ImageSpec,
    ImageStore,
    ImageStoreFull,
    resolve_in,
)
from tangram_celery.sandbox.oci import REF_NAME, write_layout

KiB = 1024


def make_tar(path: Path, entries: list[tuple[Any, ...]], gz: bool = False) -> Path:
    """A layer tar: (name, 'f', data[, mode[, uid]]), (name, 'd'[, mode]), (name, 'l', target),
    (name, 'h', target), (name, 'c') (a device node)."""
    with tarfile.open(path, "w:gz" if gz else "w", format=tarfile.PAX_FORMAT) as tf:
        for name, kind, *rest in entries:
            ti = tarfile.TarInfo(name)
            ti.mtime = 1_700_000_000
            if kind == "f":
                data = rest[0] if isinstance(rest[0], bytes) else rest[0].encode()
                ti.size = len(data)
                ti.mode = rest[1] if len(rest) > 1 else 0o644
                ti.uid = ti.gid = rest[2] if len(rest) > 2 else 0
                tf.addfile(ti, io.BytesIO(data))
                continue
            if kind == "d":
                ti.type, ti.mode = tarfile.DIRTYPE, rest[0] if rest else 0o755
            elif kind == "l":
                ti.type, ti.linkname = tarfile.SYMTYPE, rest[0]
            elif kind == "h":
                ti.type, ti.linkname = tarfile.LNKTYPE, rest[0]
            elif kind == "c":
                ti.type, ti.devmajor, ti.devminor = tarfile.CHRTYPE, 1, 3
            tf.addfile(ti)
    return path


def listing(root: Path) -> dict[str, str]:
    """Every entry below `root`: path -> 'd 755', 'f 644 DATA' or 'l TARGET'."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            rel = str(p.relative_to(root))
            mode = f"{stat.S_IMODE(st.st_mode):o}"
            if stat.S_ISLNK(st.st_mode):
                out[rel] = f"l {os.readlink(p)}"
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = f"d {mode}"
            else:
                out[rel] = f"f {mode} {p.read_text()}"
    return out


class Env:
    """An OCI dir and a store under one tmp dir."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.oci = tmp / "oci"
        self.n = 0

    def layer(self, entries: list[tuple[Any, ...]], gz: bool = False) -> Path:
        self.n += 1
        return make_tar(self.tmp / f"layer{self.n}.tar{'.gz' if gz else ''}", entries, gz)

    def image(self, ref: str, *layers: list[tuple[Any, ...]], spec: ImageSpec | None = None) -> str:
        return write_layout(self.oci, ref, [self.layer(e) for e in layers], spec or ImageSpec())

    def store(self, store_mb: int = 0, **kw: Any) -> ImageStore:
        cfg = ImagesConfig(
            store_dir=str(self.tmp / "store"), store_mb=store_mb, docker=False, oci_dirs=[str(self.oci)]
        )
        return ImageStore(cfg.model_copy(update=kw), **({"docker_url": kw["url"]} if "url" in kw else {}))

    def leftovers(self) -> list[str]:
        store = self.tmp / "store"
        return sorted(os.listdir(store / "images")) + sorted(os.listdir(store / "tmp"))


@pytest.fixture
def env(tmp_path: Path) -> Env:
    return Env(tmp_path)


def test_write_layout_makes_a_valid_oci_layout_that_several_refs_share(env: Env) -> None:
    """oci-layout, index.json with ref.name annotations, and blobs named by their digests."""
    d1 = env.image("demo/one:1", [("a", "f", "A")], spec=ImageSpec({"K": "V"}, "/src", "1000"))
    d2 = env.image("demo/two", [("b", "f", "B")])
    assert json.loads((env.oci / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads((env.oci / "index.json").read_text())
    assert {m["annotations"][REF_NAME]: m["digest"] for m in index["manifests"]} == {
        "demo/one:1": d1,
        "demo/two:latest": d2,
    }
    for blob in (env.oci / "blobs" / "sha256").iterdir():
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name
    d1b = env.image("demo/one:1", [("a", "f", "changed")])  # a ref written again is replaced
    refs = [m["annotations"][REF_NAME] for m in json.loads((env.oci / "index.json").read_text())["manifests"]]
    assert d1b != d1 and sorted(refs) == ["demo/one:1", "demo/two:latest"]


def test_layers_unpack_to_exactly_the_image_with_whiteouts_links_and_modes(env: Env) -> None:
    """Files, dirs, symlinks, hard links, whiteouts and opaque dirs; setuid dropped, devices skipped."""
    lower = [
        ("etc", "d"),
        ("etc/keep", "f", "keep"),
        ("etc/gone", "f", "gone"),
        ("etc/suid", "f", "s", 0o4755),
        ("etc/owned", "f", "o", 0o600, 1234),
        ("opt", "d"),
        ("opt/old", "f", "old"),
        ("opt/sub", "d"),
        ("opt/sub/deep", "f", "deep"),
        ("usr", "d"),
        ("usr/bin", "d"),
        ("usr/bin/tool", "f", "#!", 0o755),
        ("usr/bin/alias", "h", "usr/bin/tool"),
        ("bin", "l", "usr/bin"),
        ("dev", "d"),
        ("dev/null", "c"),
        ("ro", "d", 0o555),
        ("ro/inside", "f", "x"),
    ]
    upper = [
        ("etc/.wh.gone", "f", ""),
        ("opt/.wh..wh..opq", "f", ""),
        ("opt/new", "f", "new"),
        ("etc/keep", "f", "kept2"),
    ]
    spec = ImageSpec({"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, "/work", "")
    write_layout(env.oci, "t/one:1", [env.layer(lower), env.layer(upper, gz=True)], spec)
    image = env.store().acquire("t/one:1")
    assert image.spec == spec and image.ref == "t/one:1" and image.size_bytes > 0
    assert listing(image.rootfs) == {
        "etc": "d 755",
        "etc/keep": "f 644 kept2",
        "etc/suid": "f 755 s",
        "etc/owned": "f 600 o",
        "opt": "d 755",
        "opt/new": "f 644 new",
        "usr": "d 755",
        "usr/bin": "d 755",
        "usr/bin/tool": "f 755 #!",
        "usr/bin/alias": "f 755 #!",
        "bin": "l usr/bin",
        "dev": "d 755",
        "ro": "d 555",
        "ro/inside": "f 644 x",
    }
    tool, alias = (image.rootfs / "usr/bin/tool").stat(), (image.rootfs / "usr/bin/alias").stat()
    assert tool.st_ino == alias.st_ino
    if os.geteuid() == 0:
        assert (image.rootfs / "etc/owned").stat().st_uid == 1234


@pytest.mark.parametrize(
    "layers",
    [
        [[("../escape", "f", "x")]],
        [[("/abs", "f", "x")]],
        [[("a", "l", "/"), ("a/ESCAPE", "f", "x")]],  # through a symlink planted in the same layer
        [[("a", "l", "/")], [("a/ESCAPE", "f", "x")]],  # ... or in a lower one
        [[("a", "l", ".."), ("a/ESCAPE", "f", "x")]],
        [[("link", "h", "../outside")]],
        [[("link", "h", "missing")]],
        [[("f", "f", "x"), ("f/under", "f", "y")]],  # a file is no directory
    ],
    ids=[
        "dotdot",
        "absolute",
        "symlink-parent",
        "symlink-parent-lower",
        "dotdot-link",
        "hardlink-out",
        "hardlink-missing",
        "file-parent",
    ],
)
def test_a_layer_that_escapes_or_breaks_is_refused_and_leaves_nothing(
    env: Env, layers: list[list[tuple[Any, ...]]]
) -> None:
    """ImageCorrupt, nothing written outside the rootfs, nothing left in the store."""
    layers = [
        [(n.replace("ESCAPE", str(env.tmp / "escaped").lstrip("/")), *r) for n, *r in la] for la in layers
    ]
    env.image("bad/one", *layers)
    store = env.store()
    with pytest.raises(ImageCorrupt, match="bad/one"):
        store.acquire("bad/one")
    assert not (env.tmp / "escaped").exists() and not (env.tmp.parent / "escape").exists()
    assert env.leftovers() == [] and store.held() == [] and store.usage()["images"] == 0


def test_a_blob_that_fails_its_digest_or_is_no_tar_is_corrupt(env: Env) -> None:
    """A flipped byte, garbage, or zstd: ImageCorrupt naming the cause; the store stays empty."""
    env.image("c/flip", [("a", "f", "A" * 1000)])
    env.image("c/junk", [("b", "f", "B")])
    env.image("c/zstd", [("z", "f", "Z")])
    index = {
        m["annotations"][REF_NAME]: m["digest"]
        for m in json.loads((env.oci / "index.json").read_text())["manifests"]
    }

    def layer_blob(ref: str) -> Path:
        manifest = json.loads((env.oci / "blobs/sha256" / index[ref].split(":")[1]).read_text())
        return env.oci / "blobs/sha256" / manifest["layers"][0]["digest"].split(":")[1]

    blob = layer_blob("c/flip:latest")
    data = bytearray(blob.read_bytes())
    data[600] ^= 1
    blob.write_bytes(bytes(data))
    layer_blob("c/junk:latest").write_bytes(b"this is not a tar" * 100)
    layer_blob("c/zstd:latest").write_bytes(b"\x28\xb5\x2f\xfd" + b"\0" * 600)
    store = env.store()
    for ref, why in [("c/flip", "digest"), ("c/junk", "not a readable layer tar"), ("c/zstd", "zstd")]:
        with pytest.raises(ImageCorrupt, match=why):
            store.acquire(ref)
    assert env.leftovers() == []


def test_two_refs_of_one_image_share_one_rootfs(env: Env) -> None:
    """Content-addressed: one digest, one rootfs, counted once."""
    files = [("data", "f", "x" * 10_000)]
    env.image("same/a:1", files)
    env.image("same/b:2", files)
    store = env.store()
    a, b = store.acquire("same/a:1"), store.acquire("same/b:2")
    assert a.digest == b.digest and a.rootfs == b.rootfs
    assert store.held() == ["same/a:1", "same/b:2"]
    assert store.usage()["images"] == a.size_bytes
    assert json.loads((a.rootfs.parent / "meta.json").read_text())["refs"] == ["same/a:1", "same/b:2"]


def test_unknown_ref_is_not_found_naming_ref_and_sources(env: Env) -> None:
    """ImageNotFound names the ref and every source checked; `knows` is False."""
    env.image("there/is", [("a", "f", "A")])
    store = env.store(docker=True, url="unix:///nonexistent/docker.sock")
    with pytest.raises(
        ImageNotFound, match=r"nope/not:1.*OCI dir .*oci.*Docker engine at unix:///nonexistent"
    ):
        store.acquire("nope/not:1")
    assert not store.knows("nope/not:1") and store.knows("there/is") and store.knows("there/is:latest")
    assert store.fetchable() == ["there/is:latest"] and store.held() == []


def big(env: Env, ref: str, kib: int) -> None:
    env.image(ref, [("blob", "f", os.urandom(kib * KiB))])


def test_unused_images_are_evicted_least_recently_used_first(env: Env) -> None:
    """Budget 1 MiB, images of ~400 KiB: the oldest unused one goes; a held one never does."""
    for name in "abc":
        big(env, f"lru/{name}", 400)
    store = env.store(store_mb=1)
    for name in "ab":
        store.acquire(f"lru/{name}")
        store.release(f"lru/{name}")
    store.acquire("lru/a")  # a is now more recently used than b, and held
    store.acquire("lru/c")
    assert store.held() == ["lru/a:latest", "lru/c:latest"]
    with pytest.raises(ImageStoreFull, match=r"lru/b:latest needs .* MiB.*2 in use.*budget 1 MiB"):
        store.acquire("lru/b")  # a and c held, nothing to evict: full, and nothing left behind
    assert env.leftovers() == sorted(os.listdir(env.tmp / "store" / "images"))
    store.release("lru/a")
    store.release("lru/c")
    store.acquire("lru/b")  # now a (released before c) goes
    assert store.held() == ["lru/b:latest", "lru/c:latest"]


def test_reserve_evicts_unused_images_and_says_no_when_it_cannot(env: Env) -> None:
    """Trajectory layers share the budget: reserve evicts LRU unused images, else False."""
    big(env, "res/a", 400)
    store = env.store(store_mb=1)
    image = store.acquire("res/a")
    assert store.reserve(300 * KiB)
    assert not store.reserve(600 * KiB)  # the image is held: no room
    assert store.usage() == {"images": image.size_bytes, "layers": 300 * KiB, "budget": 1 << 20}
    store.release("res/a")
    assert store.reserve(600 * KiB) and store.held() == []  # evicted for it
    store.unreserve(900 * KiB)
    assert store.usage()["layers"] == 0 and store.layers_dir().is_dir()


def test_a_rebuilt_store_finds_what_is_on_disk_and_drops_what_died(env: Env) -> None:
    """A worker restart: images kept, no unpack again; dead processes' holds and temp dirs go."""
    env.image("keep/me", [("a", "f", "A")])
    first = env.store()
    image = first.acquire("keep/me")
    (env.oci / "index.json").unlink()  # the source is gone: the store has it
    (env.tmp / "store" / "tmp" / "999999999.1-halfdone").mkdir()
    state = json.loads((env.tmp / "store" / "state.json").read_text())
    state["holds"]["999999999.1"] = {image.digest: 3}
    (env.tmp / "store" / "state.json").write_text(json.dumps(state))
    second = env.store()
    assert second.held() == ["keep/me:latest"] and env.leftovers() == [image.digest.split(":")[1]]
    again = second.acquire("keep/me")
    assert again.rootfs == image.rootfs and (again.rootfs / "a").read_text() == "A"
    holds = json.loads((env.tmp / "store" / "state.json").read_text())["holds"]
    assert list(holds.values()) == [{image.digest: 2}]  # this process: first's hold and second's


def test_a_retagged_ref_is_fetched_anew_by_a_new_store(env: Env) -> None:
    """A ref is resolved once per process: a new process sees the re-tagged image."""
    env.image("re/tag", [("v", "f", "1")])
    old = env.store().acquire("re/tag")
    env.image("re/tag", [("v", "f", "2")])
    new = env.store().acquire("re/tag")
    assert new.digest != old.digest and (new.rootfs / "v").read_text() == "2"
    assert (old.rootfs / "v").read_text() == "1"  # still held by the first


def test_concurrent_acquires_of_one_image_unpack_it_once(env: Env) -> None:
    """Threads asking for one image while it is fetched wait for that fetch."""
    big(env, "many/one", 300)
    store = env.store()
    got: list[Any] = []
    threads = [threading.Thread(target=lambda: got.append(store.acquire("many/one"))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({g.rootfs for g in got}) == 1 and len(got) == 6
    holds = json.loads((env.tmp / "store" / "state.json").read_text())["holds"]
    assert list(holds.values()) == [{got[0].digest: 6}]
    for _ in got:
        store.release("many/one")
    assert list(json.loads((env.tmp / "store" / "state.json").read_text())["holds"].values()) == [{}]


def test_the_store_dir_is_root_only(env: Env) -> None:
    """0700, created on demand."""
    env.store()
    assert stat.S_IMODE((env.tmp / "store").stat().st_mode) == 0o700


def test_resolve_in_follows_links_inside_the_rootfs_only(tmp_path: Path) -> None:
    """Absolute links restart at the rootfs, `..` stops there; not executable or missing: None."""
    root = tmp_path / "root"
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/python3.11").write_text("#!")
    (root / "usr/bin/python3.11").chmod(0o755)
    (root / "usr/bin/python3").symlink_to("python3.11")
    (root / "bin").symlink_to("usr/bin")
    (root / "usr/bin/abs").symlink_to("/usr/bin/python3")
    (root / "usr/bin/up").symlink_to("../../../../../usr/bin/python3.11")
    (root / "usr/bin/data").write_text("x")
    (root / "usr/bin/loop").symlink_to("loop")
    (tmp_path / "hostonly").write_text("#!")
    (tmp_path / "hostonly").chmod(0o755)
    (root / "usr/bin/host").symlink_to(str(tmp_path / "hostonly"))
    assert resolve_in(root, "python3") == "/usr/bin/python3.11"
    assert resolve_in(root, "python3", "/bin") == "/usr/bin/python3.11"
    assert resolve_in(root, "abs") == "/usr/bin/python3.11"
    assert resolve_in(root, "up") == "/usr/bin/python3.11"
    assert resolve_in(root, "/bin/python3") == "/usr/bin/python3.11"
    for missing in ("data", "loop", "host", "nothere", "usr/bin/python3", "", "bin"):
        assert resolve_in(root, missing) is None, missing


def test_images_config_defaults_and_its_place_in_sandbox_config() -> None:
    """sandbox.images: a root-only store dir, a 20 GiB budget, Docker on, no OCI dirs."""
    cfg = SandboxConfig().images
    assert (cfg.store_dir, cfg.store_mb, cfg.docker, cfg.oci_dirs) == (
        "/var/lib/tangram/images",
        20480,
        True,
        [],
    )
    with pytest.raises(ValueError, match="extra"):
        ImagesConfig(store_dir="/x", nope=1)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="store_dir"):
        ImagesConfig(store_dir="/")


def test_gzip_layers_and_docker_archives_in_an_oci_dir_are_read(env: Env) -> None:
    """A `docker save`-style archive (manifest.json + layer tars) dropped in an OCI dir."""
    layer = make_tar(env.tmp / "l.tar", [("hello", "f", "world")])
    diff_id = "sha256:" + hashlib.sha256(layer.read_bytes()).hexdigest()
    config = json.dumps(
        {"config": {"Env": ["A=1"], "WorkingDir": "/w"}, "rootfs": {"diff_ids": [diff_id]}}
    ).encode()
    env.oci.mkdir()
    with tarfile.open(env.oci / "saved.tar", "w") as tf:
        for name, data in [
            ("abc.json", config),
            ("x/layer.tar", layer.read_bytes()),
            (
                "manifest.json",
                json.dumps(
                    [{"Config": "abc.json", "RepoTags": ["saved/img:v1"], "Layers": ["x/layer.tar"]}]
                ).encode(),
            ),
        ]:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    store = env.store()
    assert store.fetchable() == ["saved/img:v1"]
    image = store.acquire("saved/img:v1")
    assert (image.rootfs / "hello").read_text() == "world"
    assert image.spec == ImageSpec({"A": "1"}, "/w", "")
    assert image.digest == "sha256:" + hashlib.sha256(config).hexdigest()
    assert gzip  # gzip layers: covered by the whiteout test's upper layer


def test_an_oci_archive_and_a_layout_in_a_sub_directory_are_sources(env: Env, tmp_path: Path) -> None:
    """`*.tar` OCI archives and layouts one level down in an OCI dir are read in place."""
    layout = tmp_path / "build"
    write_layout(layout, "arch/one:1", [env.layer([("in-archive", "f", "1")])], ImageSpec())
    write_layout(env.oci / "sub", "sub/two:2", [env.layer([("in-sub", "f", "2")])], ImageSpec())
    with tarfile.open(env.oci / "images.tar", "w") as tf:
        for name in ("oci-layout", "index.json", "blobs"):
            tf.add(layout / name, arcname=name)
    store = env.store()
    assert store.fetchable() == ["arch/one:1", "sub/two:2"]
    assert (store.acquire("arch/one:1").rootfs / "in-archive").read_text() == "1"
    assert (store.acquire("sub/two:2").rootfs / "in-sub").read_text() == "2"


def test_directories_replaced_in_upper_layers_are_never_written_through(env: Env) -> None:
    """Many directories (past the unpacker's fd cache), one replaced by a symlink to / and
    written through: refused; one whited out and made again: only the new entries."""
    lower = [e for i in range(300) for e in ((f"d{i}", "d"), (f"d{i}/f", "f", str(i)))]
    env.image(
        "dirs/ok",
        lower,
        [("d8/.wh.f", "f", ""), ("d9", "l", "d8"), ("d8/new", "f", "n"), ("d10/g", "f", "g")],
    )
    image = env.store().acquire("dirs/ok")
    assert sorted(os.listdir(image.rootfs / "d8")) == ["new"] and os.readlink(image.rootfs / "d9") == "d8"
    assert len(os.listdir(image.rootfs)) == 300 and (image.rootfs / "d299/f").read_text() == "299"
    escaped = str(env.tmp / "escaped").lstrip("/")
    env.image("dirs/bad", lower, [("d7", "l", "/"), (f"d7/{escaped}", "f", "x")])
    with pytest.raises(ImageCorrupt, match="passes through 'd7'"):
        env.store().acquire("dirs/bad")
    assert not (env.tmp / "escaped").exists()


CHILD = """
import sys, time
from tangram_celery.common.config_images import ImagesConfig
from tangram_celery.sandbox.image_store import ImageStore
store = ImageStore(ImagesConfig(store_dir=sys.argv[1], store_mb=0, docker=False, oci_dirs=[sys.argv[2]]))
image = store.acquire(sys.argv[3])
print(image.rootfs, flush=True)
time.sleep(60)
"""


def test_processes_of_a_node_share_one_unpack_and_a_dead_ones_holds_go(env: Env) -> None:
    """Two processes acquiring one ref at once: one unpack; killed, their holds no longer count."""
    import subprocess
    import sys

    big(env, "proc/one", 200)
    env.image("proc/two", [("other", "f", "o")])
    store = env.store(store_mb=1)  # this process: made the store first
    argv = [sys.executable, "-c", CHILD, str(env.tmp / "store"), str(env.oci)]
    procs = [
        subprocess.Popen([*argv, ref], stdout=subprocess.PIPE, text=True)
        for ref in ("proc/one", "proc/one:latest")
    ]
    try:
        rootfs = {p.stdout.readline().strip() for p in procs if p.stdout}
        assert len(rootfs) == 1 and len(os.listdir(env.tmp / "store" / "images")) == 1
        assert store.held() == ["proc/one:latest"]
        holds = json.loads((env.tmp / "store" / "state.json").read_text())["holds"]
        assert sorted(sum(h.values()) for h in holds.values()) == [1, 1]
        assert not store.reserve(900 * KiB)  # held by the children: not evictable
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert store.reserve(900 * KiB) and store.held() == []  # the dead children's holds went
