"""`python -m scheduler.sim ...` is `tangram sim ...`."""

from scheduler.sim.cli import main

raise SystemExit(main(None))
