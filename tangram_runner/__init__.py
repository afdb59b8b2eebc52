"""The program that runs *inside* a sandbox, on the host's /usr/bin/python3: standard library only.

The host copies this package into its stage and binds the directory holding it read-only at
/opt/tangram/runner; `boot.argv` starts `runner.main` (PID 1) with that directory, and not the
working directory, first on `sys.path`. A user process drops the package's modules from
`sys.modules` (`child.prepare_python`), so its own `jobs.py` is never shadowed by the harness's.
This file imports nothing: the zygote is forked before the runner imports its own modules.
"""
