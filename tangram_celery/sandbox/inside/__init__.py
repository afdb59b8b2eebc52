"""Code that runs *inside* a sandbox, on the host's /usr/bin/python3, stdlib only.

The directory is bind-mounted read-only at /opt/tangram/runner; `runner.py` is PID 1. Modules are
prefixed `_tangram_` so that, in the forked fast path, they cannot shadow a user's `jobs.py`.
"""
