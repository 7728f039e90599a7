"""Build a file at most once per name per machine, however many processes and checkouts want it.

The name carries a digest of everything the build depends on, so two checkouts with the same
sources share one build and two with different sources never touch each other's. A finished build
is published by renaming its private directory to ``root/name``: a process that finds the file there
uses it without locking anything, and none can see a half-written one. Only building takes the
lock ``root/name.lock`` (file_lock.py: a dead builder's lock is free at once); whoever waits for it
says so in the log, and gives up after ``wait_s`` with LockTimeout rather than wait forever on a
builder that hangs.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from services.worker.attention.file_lock import held

log = structlog.get_logger(__name__)


class BuildFailed(RuntimeError):
    """The build ran but did not produce its file."""


def build_once(root: Path, name: str, artifact: str, build: Callable[[Path], None], wait_s: float) -> Path:
    """``root/name/artifact``, made first by ``build(directory)`` (which must write ``directory/artifact``)
    unless some process already has. Raises LockTimeout when another builder held the lock for ``wait_s``
    seconds, BuildFailed or whatever ``build`` raised when building fails."""
    published = root / name / artifact
    if published.is_file():
        return published
    root.mkdir(parents=True, exist_ok=True)
    lock = root / f"{name}.lock"
    with held(lock, wait_s, on_wait=lambda holder: log.info(
            "build_waiting", lock=str(lock), holder=holder, wait_s=wait_s,
            why="another process is building this; it is used once published")):
        if published.is_file():  # built while this process waited
            return published
        _clear_leftovers(root, name)
        _build_and_publish(root, name, artifact, build)
    return published


def _build_and_publish(root: Path, name: str, artifact: str, build: Callable[[Path], None]) -> None:
    private = Path(tempfile.mkdtemp(prefix=f"{name}{BUILDING}", dir=root))
    started = time.monotonic()
    log.info("build_started", directory=str(private), publishes=str(root / name))
    try:
        build(private)
        if not (private / artifact).is_file():
            raise BuildFailed(f"the build left no {artifact} in {private}")
        private.chmod(0o755)  # mkdtemp's 0700 would hide it from other users of a shared directory
        os.rename(private, root / name)
    except BaseException:
        shutil.rmtree(private, ignore_errors=True)
        raise
    log.info("build_finished", published=str(root / name), seconds=round(time.monotonic() - started, 1))


BUILDING = ".building-"  # a private build directory's infix


def _clear_leftovers(root: Path, name: str) -> None:
    """What builders that died left behind (only a lock holder calls this: no build of ``name`` is live)."""
    for leftover in [root / name, *root.glob(f"{name}{BUILDING}*")]:
        shutil.rmtree(leftover, ignore_errors=True)
