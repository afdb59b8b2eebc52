"""Sandboxes in a container image against host-toolchain sandboxes, side by side, on both backends.

    .venv/bin/python benchmarks/image_sandboxes.py [--new 12] [--warm 20] [--concurrent 64]

Issue 36's targets: the first action of a new trajectory in a cached image (p50 <= 150 ms on the
namespace backend, <= 500 ms on Docker), warm actions within 5 ms of a host-toolchain sandbox,
and N concurrent trajectories of one image using no more disk than the image plus their layers.

The image is a Debian bookworm minbase root file system with python3 and python3-pytest made by
mmdebstrap (cached under ~/.cache/tangram/bench-images), as an OCI layout in the namespace
backend's image store and `docker import`ed into a private engine (overlay2). Per backend, in one
run: `--new` new trajectories one after another, `NEW_GAP_S` apart (a trajectory's arrival; the
ready sandboxes of each kind refill in between, `sandbox.prewarm` for the host's and
`sandbox.images.prewarm` for the image's, both 2), each timed from the call to its result; then
`--warm` actions in one trajectory of each kind; then (namespace) `--concurrent` trajectories of
the image alive at once, each having written 1 MiB, with the store's and the layers' bytes.
Writes benchmarks/results/image_sandboxes.json and image_sandboxes.png.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, write_json
from tangram_celery.common.config import SandboxConfig
from tangram_celery.sandbox.base import ExecRequest

IMAGE = "bench/python:bookworm"
NEW_GAP_S = 0.6
MMDEBSTRAP = ["mmdebstrap", "--variant=minbase", "--include=python3,python3-pytest", "bookworm"]
CACHE = Path(os.environ.get("TANGRAM_CACHE", Path.home() / ".cache" / "tangram")) / "bench-images"


def base_tar() -> Path:
    """The image's root file system, built once (mmdebstrap, ~25 s) and cached."""
    out = CACHE / "bookworm-python3-pytest.tar"
    if not out.exists():
        if shutil.which("mmdebstrap") is None:
            raise SystemExit("mmdebstrap is needed: apt-get install mmdebstrap")
        CACHE.mkdir(parents=True, exist_ok=True)
        print(f"building {out} with mmdebstrap ...", flush=True)
        part = out.with_name(out.stem + ".part.tar")  # mmdebstrap picks its format by the suffix
        subprocess.run([*MMDEBSTRAP, str(part)], check=True, capture_output=True)
        os.rename(part, out)
    return out


def du(path: Path) -> int:
    """Bytes of the files under `path` (each inode once), as `du` counts them."""
    out = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=False)
    return int(out.stdout.split()[0]) if out.returncode == 0 and out.stdout else 0


def timed(box: Any, tid: str, image: str | None, code: str) -> float:
    t0 = time.monotonic()
    res = box.run(tid, ExecRequest(language="bash", code=code, image=image, cores=(0,)))
    dt = time.monotonic() - t0
    if res.status.value != "ok":
        raise RuntimeError(f"{tid}: {res.status} {res.detail} {res.stderr[-300:]}")
    return dt


def measure(box: Any, label: str, new: int, warm: int) -> dict[str, Any]:
    """First actions of new trajectories, host toolchain and image in turn (each `NEW_GAP_S`
    after the last: the arrival of the next); then warm actions of one trajectory of each kind,
    alternating, so that both see the same load (paired differences)."""
    out: dict[str, Any] = {}
    kinds = (("host", None), ("image", IMAGE))
    for kind, image in kinds:
        timed(box, f"{label}-{kind}-prime", image, "true")  # the image's first fetch; pools start
        time.sleep(2.0)
        firsts = []
        for i in range(new):
            time.sleep(NEW_GAP_S)
            firsts.append(timed(box, f"{label}-{kind}-n{i}", image, "echo hi > f; cat f"))
        out[kind] = {"first_s": firsts, "first_p50_s": statistics.median(firsts), "warm_s": []}
    for _ in range(warm):
        for kind, image in kinds:
            out[kind]["warm_s"].append(timed(box, f"{label}-{kind}-n0", image, "cat f"))
    for kind, _ in kinds:
        out[kind]["warm_p50_s"] = statistics.median(out[kind]["warm_s"])
        print(
            f"{label} {kind}: first action p50 {out[kind]['first_p50_s'] * 1000:.1f} ms, "
            f"warm p50 {out[kind]['warm_p50_s'] * 1000:.1f} ms",
            flush=True,
        )
    pairs = zip(out["image"]["warm_s"], out["host"]["warm_s"], strict=True)
    out["warm_delta_ms"] = (out["image"]["warm_p50_s"] - out["host"]["warm_p50_s"]) * 1000
    out["warm_paired_delta_p50_ms"] = statistics.median((i - h) * 1000 for i, h in pairs)
    print(f"{label}: warm image - host, paired p50 {out['warm_paired_delta_p50_ms']:.1f} ms", flush=True)
    return out


def concurrent_disk(box: Any, store: Path, n: int) -> dict[str, Any]:
    """`n` trajectories of the image alive at once, each with 1 MiB written: the store's disk
    against one unpacked copy of the image, and the layers' bytes (tmpfs, charged to memory)."""
    for i in range(n):
        timed(box, f"disk-{i}", IMAGE, "head -c 1048576 /dev/zero > blob")
    with box._lock:
        layers = [
            h.layer.used_bytes()
            for t, h in box._handles.items()
            if t.startswith("disk-") and h.layer is not None
        ]
    image_bytes = int(box.images.store.usage()["images"])
    store_disk = du(store / "images")
    return {
        "trajectories": n,
        "live_layers": len(layers),
        "image_bytes": image_bytes,
        "store_disk_bytes": store_disk,
        "copies_of_image_on_disk": round(store_disk / image_bytes, 3) if image_bytes else None,
        "layers_bytes": sum(layers),
        "image_plus_layers_bytes": image_bytes + sum(layers),
        "store_disk_plus_layers_bytes": store_disk + sum(layers),
    }


@contextlib.contextmanager
def namespace_box(work: Path, layout: Path) -> Iterator[Any]:
    from tangram_celery.sandbox.namespace import NamespaceSandbox

    images = {"store_dir": str(work / "store"), "docker": False, "oci_dirs": [str(layout)]}
    box = NamespaceSandbox(SandboxConfig(backend="namespace", stage_dir=str(work / "stage"), images=images))
    box.start_prewarm()
    try:
        yield box
    finally:
        box.close()


@contextlib.contextmanager
def docker_box(work: Path, tar: Path) -> Iterator[Any]:
    import docker

    from tangram_celery.sandbox.docker import DockerSandbox
    from tests.fixtures.docker import private_dockerd

    with private_dockerd("overlay2") as url:
        client = docker.DockerClient(base_url=url, timeout=600)
        with open(tar, "rb") as f:
            repo, tag = IMAGE.split(":")
            client.api.import_image_from_data(f.read(), repository=repo, tag=tag, changes=["WORKDIR /repo"])
        client.close()
        box = DockerSandbox(SandboxConfig(backend="docker", docker_host=url, stage_dir=str(work / "dstage")))
        box.start_prewarm()
        try:
            yield box
        finally:
            box.close()


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, backend in zip(axes, ("namespace", "docker"), strict=True):
        d = data.get(backend)
        if not d:
            continue
        for kind in ("host", "image"):
            ax.plot([x * 1000 for x in d[kind]["first_s"]], marker="o", label=f"{kind}: new trajectory")
        ax.set_title(f"{backend}: first action of a new trajectory")
        ax.set_xlabel("trajectory")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new", type=int, default=12, help="new trajectories per kind and backend")
    ap.add_argument("--warm", type=int, default=40, help="warm actions per kind and backend")
    ap.add_argument("--concurrent", type=int, default=64, help="live trajectories of one image (namespace)")
    ap.add_argument("--backends", default="namespace,docker")
    args = ap.parse_args(argv)
    from tangram_celery.sandbox.oci import ImageSpec, write_layout

    tar = base_tar()
    data: dict[str, Any] = {"image": IMAGE, "image_tar_bytes": tar.stat().st_size, "new_gap_s": NEW_GAP_S}
    with tempfile.TemporaryDirectory(prefix="tangram-image-bench-") as tmp:
        work = Path(tmp)
        layout = work / "oci"
        write_layout(
            layout, IMAGE, [tar], ImageSpec(env={"PATH": "/usr/local/bin:/usr/bin:/bin"}, workdir="/repo")
        )
        backends = args.backends.split(",")
        if "namespace" in backends:
            with namespace_box(work, layout) as box:
                data["namespace"] = measure(box, "ns", args.new, args.warm)
                data["namespace"]["disk"] = concurrent_disk(box, work / "store", args.concurrent)
                print(f"disk: {data['namespace']['disk']}", flush=True)
        if "docker" in backends:
            with docker_box(work, tar) as box:
                data["docker"] = measure(box, "docker", args.new, args.warm)
    data["load_average_1m_at_end"] = os.getloadavg()[0]
    data["cpus"] = os.cpu_count()
    write_json("image_sandboxes", data)
    plot(data, RESULTS / "image_sandboxes.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
