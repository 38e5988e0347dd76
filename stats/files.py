"""Files the stats write: whole or not at all."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any


def atomic_write_json(path: str | os.PathLike, data: Any) -> None:
    """Written to a temporary file then renamed (a reader never sees a torn file), world-readable."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=False)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; a report is for everyone
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
