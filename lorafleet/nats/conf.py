"""Small helpers for the files lorafleet writes for nats-server: config quoting, and private files.

`conf_quote` is the one quoting rule for strings in a nats-server config (the authorization block of
nats_auth.py and the server/cluster blocks of nats_server.py use it). `write_private` writes a file that
holds a secret (the server config with the cluster's route password, a TLS key) so that it is never
readable by anyone else, not even for an instant: created 0600 under a temporary name with O_EXCL (a
stale file is never reused, so its old mode never applies), written, flushed, then renamed into place.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

PRIVATE = 0o600


def conf_quote(s: str | Path) -> str:
    """A double-quoted string for the nats-server config (quoted, `$JS…` is not read as a variable)."""
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_private(path: str | Path, data: bytes | str, mode: int = PRIVATE) -> None:
    """Write `data` to `path` atomically, the file created with `mode` (default 0600) from its first byte.

    The umask can only take bits away from `mode`, never add any, so no chmod is needed afterwards."""
    target = Path(path)
    body = data.encode() if isinstance(data, str) else data
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        view = memoryview(body)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, target)
