"""An exclusive lock on a file, which its holder's death releases, waited on for a bounded time.

The lock is flock(2): the kernel drops it when the holder's last descriptor closes, however the
holder ends (kill -9 included), so a lock left by a dead process is free to the next one at once.
Nothing is judged by process ids (which another container sharing the directory would not see, and
which get reused); the file merely names its current holder, for the log lines of those waiting.
The file itself stays: removing it would let two processes lock two different files of one name.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: held() says so, and importing this module still works
    fcntl = None

POLL_S = 0.2  # how often a waiter tries again (flock has no timed wait)


class LockTimeout(TimeoutError):
    """Another process held the lock for the whole wait."""

    def __init__(self, path: Path, holder: str | None, waited_s: float):
        self.path, self.holder, self.waited_s = path, holder, waited_s
        super().__init__(f"{path} was still locked after {waited_s:.0f} s (held by {holder or 'an unknown process'})")


@contextmanager
def held(path: Path, wait_s: float, on_wait: Callable[[str | None], None]) -> Iterator[None]:
    """Holds ``path``'s lock for the ``with`` body; ``on_wait(holder)`` is called once if another process
    holds it first; LockTimeout after ``wait_s`` seconds of waiting."""
    if fcntl is None:
        raise OSError("file locks need a POSIX system (fcntl.flock)")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(fd, path, wait_s, on_wait)
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        yield
    finally:
        os.close(fd)  # releases the lock


def _acquire(fd: int, path: Path, wait_s: float, on_wait: Callable[[str | None], None]) -> None:
    started, told = time.monotonic(), False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            waited_s = time.monotonic() - started
        if waited_s >= wait_s:
            raise LockTimeout(path, holder_of(path), waited_s)
        if not told:
            on_wait(holder_of(path))
            told = True
        time.sleep(POLL_S)


def holder_of(path: Path) -> str | None:
    """Who last took the lock, as that process wrote it; None when unreadable or not yet written."""
    try:
        return path.read_text().strip() or None
    except OSError:
        return None
