"""Files that hold secrets (broker URLs with passwords, the aclfile, role passwords): written
whole or not at all, readable by their owner alone."""

from __future__ import annotations

import os
from pathlib import Path


def write_private(path: str | os.PathLike[str], text: str) -> Path:
    """Write `text` to `path` with mode 0600, atomically (a temporary file beside it, renamed
    over it): a reader sees the old text or the new, and a file that was readable by others
    before is replaced, not rewritten in place with its old mode."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # a leftover temporary file keeps its own mode otherwise
        f.write(text)
    os.replace(tmp, path)
    return path
