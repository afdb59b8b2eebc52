"""The image store's settings (`sandbox.images`): where a node keeps image root filesystems for
the namespace backend, how much disk they and trajectories' spilled layers may take, and which
operator-configured sources images come from (docs/images.md, Image store)."""

from __future__ import annotations

from pydantic import Field, field_validator

from tangram_celery.common.config_front import StrictModel


class ImagesConfig(StrictModel):
    """The per-node image store of the namespace backend."""

    store_dir: str = Field(
        "/var/lib/tangram/images",
        description="root-only (0700) directory of the node's image store: unpacked root filesystems, "
        "trajectories' spilled layers; created on demand, shared by the node's workers",
    )
    store_mb: int = Field(
        20480,
        ge=0,
        le=1 << 30,
        description="disk budget of the store, MiB: images plus reserved trajectory layers; unused "
        "images are evicted least recently used first to make room (0: unlimited)",
    )
    docker: bool = Field(
        True,
        description="fetch images from the node's Docker engine (sandbox.docker_host) when one answers",
    )
    oci_dirs: list[str] = Field(
        default_factory=list,
        description="directories to fetch images from: each an OCI image layout (index.json refs "
        "annotated with org.opencontainers.image.ref.name), holding *.tar OCI or docker archives "
        "and sub-directories that are layouts; asked before the Docker engine",
    )

    prewarm: int = Field(
        2,
        ge=0,
        le=64,
        description="ready sandboxes kept per image for its next new trajectories, on each CPU node "
        "that ran it (0: none; a new trajectory then waits for its sandbox to start)",
    )
    warm_images: int = Field(
        4,
        ge=0,
        le=256,
        description="images kept warm (`prewarm` each) on a node: the ones its new trajectories used "
        "last; an older one's ready sandboxes are removed",
    )

    @field_validator("store_dir")
    @classmethod
    def _store_dir(cls, v: str) -> str:
        if not v.strip() or v.strip() == "/":
            raise ValueError("store_dir must name a directory of its own, e.g. /var/lib/tangram/images")
        return v

    @field_validator("oci_dirs")
    @classmethod
    def _oci_dirs(cls, v: list[str]) -> list[str]:
        if any(not d.strip() for d in v):
            raise ValueError("oci_dirs entries must be directory paths")
        return v
