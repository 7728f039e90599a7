"""Where pagedserve keeps what it makes once and reuses (the built-in models, GGUF files' model directories),
and how a folder there is made so that concurrent processes see none or a whole one."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    """$PAGEDSERVE_CACHE, else ~/.cache/pagedserve."""
    return Path(os.environ.get("PAGEDSERVE_CACHE") or Path.home() / ".cache" / "pagedserve")


def made_once(final: Path, fill: Callable[[Path], object], marker: str = "config.json") -> Path:
    """``final``, filled by ``fill(folder)`` unless it holds ``marker`` already: built in a private folder
    beside it and renamed into place."""
    if (final / marker).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        fill(work)
        os.rename(work, final)
    except OSError:
        if not (final / marker).is_file():  # not simply another process winning the race
            raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final
