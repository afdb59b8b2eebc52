"""How the host and the runner start a program of this package (stdlib only, imports nothing).

`python3 -E -s -S -c CODE`: no environment variable, no user site, no `site`; CODE puts the
directory that holds `tangram_runner` first on `sys.path` and calls the module's `main`. `-c`
alone would put "" there, the working directory, which user code may write: CODE drops it
before anything of the package is imported, so what the harness imports comes from `root` (in
a sandbox, /opt/tangram/runner, read-only) and the interpreter's own directories only.
"""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the directory holding the package


def argv(python: str, root: str, module: str) -> list[str]:
    """The command that runs `tangram_runner.<module>.main()` under `python`, the package
    imported from `root`; arguments for `main` go after it (`sys.argv[0]` is "-c")."""
    code = (
        f"import sys; sys.path[:] = [{root!r}, *(p for p in sys.path if p)]; "
        f"from tangram_runner.{module} import main; main()"
    )
    return [python, "-E", "-s", "-S", "-c", code]
