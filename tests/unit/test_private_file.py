"""Secret files (`transport.private_file`): 0600 and whole, whatever was there before."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tangram_celery.transport.private_file import write_private


def test_a_secret_replaces_a_file_others_could_read_and_never_follows_a_link(tmp_path: Path) -> None:
    """Given a URL file left readable by all (0644) and a leftover temporary file of mode 0666,
    the new secret is 0600 and whole; a symlink planted as the temporary file is refused."""
    path = tmp_path / "broker.url"
    path.write_text("redis://old")
    os.chmod(path, 0o644)
    tmp = tmp_path / "broker.url.tmp"
    tmp.write_text("junk")
    os.chmod(tmp, 0o666)
    assert write_private(path, "redis://admin:pw@127.0.0.1:1/0") == path
    assert path.read_text() == "redis://admin:pw@127.0.0.1:1/0"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and not tmp.exists()

    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("untouched")
    tmp.symlink_to(elsewhere)
    with pytest.raises(OSError):
        write_private(path, "redis://new")
    assert elsewhere.read_text() == "untouched" and path.read_text() == "redis://admin:pw@127.0.0.1:1/0"
