"""A SWE-style workload built here with no registry: task images from a Debian root filesystem
(mmdebstrap) and real PyPI projects with an injected bug, a scripted agent trajectory, and the
`tangram demo --workload swe` driver. See docs/swe.md."""
