"""How the host and the runner start a program of this package (stdlib only, imports nothing).

`python3 -E -s -S -c CODE`: no environment variable, no user site, no `site`; CODE puts the
directory that holds `tangram_runner` first on `sys.path` and calls the module's `main`. `-c`
alone would put "" there, the working directory, which user code may write: CODE drops it
before anything of the package is imported, so what the harness imports comes from `root` (in
a sandbox, /opt/tangram/runner, read-only) and the interpreter's own directories only.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the directory holding the package
# In a sandbox of a container image, the host's interpreter runs from where the host's /usr is
# mounted, through the host's dynamic loader (`tangram_celery.sandbox.image_root`): that command
# comes in this variable, as a JSON list (the image's own loader and libc may not fit it).
PYTHON_ENV = "TANGRAM_HOST_PYTHON"


def python() -> list[str]:
    """The command that starts this interpreter again (the loader's command in an image)."""
    import json

    given = os.environ.get(PYTHON_ENV)
    return [str(a) for a in json.loads(given)] if given else [sys.executable]


def own_paths(under: str = "") -> list[str]:
    """The interpreter's own directories on `sys.path` (its prefix + `under`), never the
    working directory's or a user's: /usr/... on the host, its mount point in an image."""
    prefix = sys.base_prefix.rstrip("/") + under + "/"
    return [p for p in sys.path if p.startswith(prefix)]


def argv(python: str | list[str], root: str, module: str) -> list[str]:
    """The command that runs `tangram_runner.<module>.main()` under `python` (a path, or a
    loader's command), the package imported from `root`; arguments for `main` go after it
    (`sys.argv[0]` is "-c")."""
    code = (
        f"import sys; sys.path[:] = [{root!r}, *(p for p in sys.path if p)]; "
        f"from tangram_runner.{module} import main; main()"
    )
    return [*([python] if isinstance(python, str) else python), "-E", "-s", "-S", "-c", code]
