"""Building the C++ CPU kernels once per machine: a dead builder's lock is taken over, a live one that
never finishes is waited on for a bounded time (then the worker falls back to the torch backend,
saying which lock), concurrent wanters build once, and builds of different sources never collide.

The locking and publishing are exercised with a stand-in build (a file written in milliseconds); the
real compile runs once per test run (tests/conftest.py) and the kernel tests load its result.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from services.worker.attention import build_once as build_once_module
from services.worker.attention import cpu_kernels
from services.worker.attention.build_once import BuildFailed, build_once
from services.worker.attention.file_lock import LockTimeout
from tests.services_harness import REPO

NAME = "kernels_0123abcd"
ARTIFACT = "kernels.so"

# A process that takes the build lock as a builder does, says so, and then does what its stdin says:
# "publish" (as a finished build would, then exit) or nothing (it holds the lock until killed).
HOLDER = """
import sys
from pathlib import Path
from services.worker.attention.file_lock import held
root, name, artifact = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
with held(root / f"{name}.lock", wait_s=0, on_wait=print):
    (root / f"{name}.building-killed").mkdir()
    print("locked", flush=True)
    if sys.stdin.readline().strip() == "publish":
        (root / name).mkdir()
        (root / name / artifact).write_text("built by the holder")
"""


class Builds:
    """A stand-in build that counts its runs."""

    def __init__(self, content: str = "built"):
        self.content, self.runs = content, 0

    def __call__(self, directory: Path) -> None:
        self.runs += 1
        (directory / ARTIFACT).write_text(self.content)


class RecordedLog:
    """build_once's logger, recording events; ``waiting`` is set once a caller waits for the lock."""

    def __init__(self):
        self.events: list[tuple[str, dict]] = []
        self.waiting = threading.Event()

    def info(self, event: str, **fields) -> None:
        self.events.append((event, fields))
        if event == "build_waiting":
            self.waiting.set()

    warning = info


@pytest.fixture
def recorded(monkeypatch) -> RecordedLog:
    log = RecordedLog()
    monkeypatch.setattr(build_once_module, "log", log)
    return log


@pytest.fixture
def holder(tmp_path):
    """Starts a lock holder for NAME under tmp_path (returned once it holds the lock); killed at the end."""
    procs = []

    def start(name: str = NAME, root: Path = tmp_path) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(root), name, ARTIFACT], cwd=REPO, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append(proc)
        line = proc.stdout.readline()  # blocks until it holds the lock (or has died)
        assert line == "locked\n", line + proc.stdout.read()
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_lock_left_by_a_killed_builder_is_taken_over(tmp_path, holder):
    proc = holder()
    with pytest.raises(LockTimeout, match="held by pid"):  # really held while it lives
        build_once(tmp_path, NAME, ARTIFACT, Builds(), wait_s=0)
    proc.send_signal(signal.SIGKILL)  # killed mid-build: the lock file and a half-built directory stay
    proc.wait()
    assert (tmp_path / f"{NAME}.lock").exists() and (tmp_path / f"{NAME}.building-killed").exists()
    build = Builds()
    path = build_once(tmp_path, NAME, ARTIFACT, build, wait_s=0)  # no waiting needed: the lock died with it
    assert build.runs == 1 and path == tmp_path / NAME / ARTIFACT and path.read_text() == "built"
    assert sorted(p.name for p in tmp_path.iterdir()) == [NAME, f"{NAME}.lock"]  # the leftover is gone


def test_a_touched_lock_file_blocks_nothing(tmp_path):
    (tmp_path / f"{NAME}.lock").touch()
    build = Builds()
    assert build_once(tmp_path, NAME, ARTIFACT, build, wait_s=0).read_text() == "built" and build.runs == 1


def test_a_live_builder_that_never_finishes_times_out_naming_the_lock(tmp_path, holder, recorded):
    holder()
    build = Builds()
    with pytest.raises(LockTimeout) as caught:
        build_once(tmp_path, NAME, ARTIFACT, build, wait_s=0.5)
    lock = tmp_path / f"{NAME}.lock"
    assert caught.value.path == lock and caught.value.holder.startswith("pid ") and build.runs == 0
    assert str(lock) in str(caught.value)
    # It said it was waiting, and on whom, as it began to wait: a worker never waits silently.
    (event, fields), = recorded.events
    assert event == "build_waiting" and fields["lock"] == str(lock) and fields["holder"].startswith("pid ")


def test_a_worker_whose_kernel_build_never_finishes_falls_back_to_torch(tmp_path, holder, monkeypatch, recorded):
    from services.worker.attention import selector
    from services.worker.attention.torch_ref import TorchAttentionBackend

    if shutil.which(cpu_kernels._compiler()) is None:
        pytest.skip("no C++ compiler: the fallback has another reason here")
    holder(name=cpu_kernels.build_name())
    monkeypatch.setattr(cpu_kernels, "_build", lambda: cpu_kernels.load_cpu_kernels(tmp_path, wait_s=0.5))
    selector_log = RecordedLog()  # (structlog's capture_logs misses a logger cached by an earlier test)
    monkeypatch.setattr(selector, "log", selector_log)
    assert selector.select_attention_backend("auto", torch.device("cpu")) is TorchAttentionBackend
    (event, fields), = selector_log.events
    lock = tmp_path / f"{cpu_kernels.build_name()}.lock"
    assert event == "cpu_kernels_unavailable" and str(lock) in fields["reason"] and fields["fallback"] == "torch"
    assert not (tmp_path / cpu_kernels.build_name()).exists()


def test_one_builds_while_the_others_wait_for_its_result(tmp_path, holder, recorded):
    proc = holder()  # the first builder, still compiling
    build, result = Builds(), {}
    waiter = threading.Thread(target=lambda: result.update(path=build_once(tmp_path, NAME, ARTIFACT, build,
                                                                            wait_s=600)))
    waiter.start()
    try:
        assert recorded.waiting.wait(600), recorded.events  # blocked on the lock, not building too
        proc.stdin.write("publish\n")
        proc.stdin.flush()
        assert proc.wait(600) == 0
    finally:
        waiter.join(600)
    assert build.runs == 0 and result["path"].read_text() == "built by the holder"


def test_builds_of_different_digests_do_not_collide(tmp_path):
    first, second = Builds("first sources"), Builds("second sources")
    one = build_once(tmp_path, "kernels_aaaa", ARTIFACT, first, wait_s=0)
    other = build_once(tmp_path, "kernels_bbbb", ARTIFACT, second, wait_s=0)
    assert one.parent != other.parent
    # Another checkout with either's sources finds its build and builds nothing.
    again = Builds("not used")
    assert build_once(tmp_path, "kernels_aaaa", ARTIFACT, again, wait_s=0).read_text() == "first sources"
    assert build_once(tmp_path, "kernels_bbbb", ARTIFACT, again, wait_s=0).read_text() == "second sources"
    assert (first.runs, second.runs, again.runs) == (1, 1, 0)


def test_the_digest_follows_the_sources_not_the_checkout(tmp_path, monkeypatch):
    here = cpu_kernels.build_digest()
    checkout = tmp_path / "other-checkout" / "csrc"
    shutil.copytree(cpu_kernels.SOURCES[0].parent, checkout)
    monkeypatch.setattr(cpu_kernels, "SOURCES", [checkout / source.name for source in cpu_kernels.SOURCES])
    assert cpu_kernels.build_digest() == here  # same sources elsewhere: the same build
    header = checkout / "vec_math.h"
    header.write_text(header.read_text() + "\n// changed\n")
    assert cpu_kernels.build_digest() != here  # a header counts too
    monkeypatch.setenv("CXX", "clang++")
    header.write_text(header.read_text().removesuffix("\n// changed\n"))
    assert cpu_kernels.build_digest() != here  # and the compiler


def test_a_failed_build_publishes_nothing_and_the_next_one_builds(tmp_path):
    def broken(directory: Path) -> None:
        (directory / "half.o").write_text("")
        raise RuntimeError("the compiler failed")

    with pytest.raises(RuntimeError, match="the compiler failed"):
        build_once(tmp_path, NAME, ARTIFACT, broken, wait_s=0)
    with pytest.raises(BuildFailed, match=f"no {ARTIFACT}"):
        build_once(tmp_path, NAME, ARTIFACT, lambda directory: None, wait_s=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{NAME}.lock"]
    build = Builds()
    assert build_once(tmp_path, NAME, ARTIFACT, build, wait_s=0).read_text() == "built" and build.runs == 1


def test_build_command_says_where_or_why_not(tmp_path):
    def run(**env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "services.worker.attention.cpu_kernels"], cwd=REPO,
                              env={**os.environ, **env}, capture_output=True, text=True, timeout=600)

    missing = run(CXX=str(tmp_path / "no-such-compiler"))
    assert missing.returncode == 1 and missing.stdout.strip() == "no C++ compiler found (install g++, or set CXX)"
    if cpu_kernels.cpu_kernels_unavailable_reason() is None:  # built for this run (tests/conftest.py)
        ready = run()
        assert ready.returncode == 0, ready.stdout + ready.stderr
        assert ready.stdout.strip().endswith(cpu_kernels.build_name()), ready.stdout


@pytest.mark.skipif(shutil.which(cpu_kernels._compiler()) is None, reason="no C++ compiler on this machine")
def test_the_kernels_build_where_a_compiler_is():
    """Where a compiler exists the C++ kernels must build: a source that does not compile would otherwise
    only make the kernel tests skip, and every CPU worker fall back to the torch backend, unnoticed."""
    assert cpu_kernels.cpu_kernels_unavailable_reason() is None
