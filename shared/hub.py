"""A model or tokenizer named as a local directory or as a Hugging Face Hub id (`org/name`), as vLLM's
--model takes either: a directory that exists is used as it is; any other name is a repository on the Hub,
resolved through huggingface_hub into its cache (HF_HOME / HF_HUB_CACHE, or --download-dir), with only the
files serving needs, at --revision. HF_HUB_OFFLINE=1 serves from the cache with no network; HF_TOKEN (or
`hf auth login`) opens private and gated repositories, as huggingface_hub reads them.

What goes wrong is one line naming the id, the revision and what was tried (HubError, a ValueError)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from shared.gguf_view import GGUF_FILE, gguf_model_dir, names_a_gguf_file

# Everything serving reads but the weights: config and generation config, tokenizers of every kind, chat
# templates, sentence-transformers' pooling files. Small, so taken whole, subfolders included.
SMALL_FILES = ["*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken"]
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
_ROOT_ONLY = ["*/*"]  # weights are the top folder's: a repo may keep other copies below (original/, onnx/)
# A path in huggingface_hub's cache: <cache>/models--<org>--<name>/snapshots/<commit>
_SNAPSHOT = re.compile(r"models--(?P<repo>.+?)/snapshots/[^/]+/?$")


class HubError(ValueError):
    """A Hub id that could not be resolved to a local snapshot."""


def local_or_hub(name: str, *, revision: str | None = None, download_dir: str | None = None,
                 weights: bool = True) -> Path:
    """The directory ``name`` stands for: itself when it is one, else the Hub repository's snapshot
    (downloaded where missing). weights=False: a tokenizer's files only."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    return snapshot(name, revision=revision, download_dir=download_dir, weights=weights)


def names_a_hub_repo(name: str) -> bool:
    """Whether ``name`` is no local directory but could be a Hub id (org/name)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if Path(name).expanduser().is_dir():
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def local_model_and_tokenizer(model: str | None, tokenizer: str | None, *, revision: str | None = None,
                              tokenizer_revision: str | None = None, download_dir: str | None = None
                              ) -> tuple[str | None, str | None]:
    """--model and --tokenizer as local folders, resolved once by the program that starts the others (the
    launcher, the offline LLM), so that every process reads the same snapshot however the Hub moves."""
    if tokenizer:
        tokenizer = str(local_or_hub(tokenizer, revision=tokenizer_revision, download_dir=download_dir, weights=False))
    if names_a_gguf_file(model):  # a directory standing for the file, the tokenizer's files in it
        model = str(gguf_model_dir(model, tokenizer))
    elif model:
        model = str(local_or_hub(model, revision=revision, download_dir=download_dir))
    return model, tokenizer


def snapshot(repo_id: str, *, revision: str | None, download_dir: str | None, weights: bool) -> Path:
    """The local snapshot of the repository at the revision (None: main)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:  # a path, then
        raise FileNotFoundError(f"model directory {repo_id} does not exist or is not a directory (nor is it a "
                                "Hugging Face Hub id, org/name)") from None
    where = _described(repo_id, revision)
    try:
        root = Path(_download(repo_id, revision, download_dir, SMALL_FILES))
        if weights and not _weight_files(root):
            _download_weights(repo_id, revision, download_dir, root)
    except Exception as exc:  # huggingface_hub's errors, and requests' or httpx's beneath them
        raise HubError(f"{where}: {_reason(exc, download_dir)}") from None
    if not (root / "config.json").is_file() and weights:
        raise HubError(f"{where}: the snapshot at {root} has no config.json; is it a transformers model?")
    if weights and not _weight_files(root):
        raise HubError(f"{where}: the snapshot at {root} has no *.safetensors or pytorch_model*.bin weights"
                       + (" (HF_HUB_OFFLINE=1: only what the cache holds is used)" if _offline() else ""))
    return root


def hub_id_of(path: str | Path) -> str | None:
    """The repository a snapshot directory of huggingface_hub's cache holds (None: another directory)."""
    found = _SNAPSHOT.search(Path(path).as_posix())
    return found["repo"].replace("--", "/") if found else None


def model_name(path: str | Path) -> str:
    """The name a model is served under by default: its Hub id for a cached snapshot, a GGUF file's name for
    the folder standing for it, else its folder's name."""
    gguf = Path(path) / GGUF_FILE
    if gguf.is_symlink():
        return gguf.resolve().name
    return hub_id_of(path) or Path(path).name or str(path)


def _download(repo_id: str, revision: str | None, download_dir: str | None, allow: list[str],
              ignore: list[str] | None = None) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, revision=revision, cache_dir=download_dir, allow_patterns=allow,
                             ignore_patterns=ignore)


def _download_weights(repo_id: str, revision: str | None, download_dir: str | None, root: Path) -> None:
    """The top folder's safetensors (only the shards an index lists, where it has one); where the repository
    has none, its pytorch_model*.bin."""
    for index, pattern in ((SAFETENSORS_INDEX, "*.safetensors"), (BIN_INDEX, "pytorch_model*.bin")):
        shards = _indexed_shards(root / index)
        _download(repo_id, revision, download_dir, shards or [pattern], None if shards else _ROOT_ONLY)
        if _weight_files(root):
            return


def _indexed_shards(index: Path) -> list[str]:
    if not index.is_file():
        return []
    try:
        return sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError):
        return []  # the loader names the broken index


def _weight_files(root: Path) -> bool:
    return any(root.glob("*.safetensors")) or any(root.glob("pytorch_model*.bin"))


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _described(repo_id: str, revision: str | None) -> str:
    at = f" at revision {revision!r}" if revision else ""
    return f"model {repo_id!r} (not a local directory, so a Hugging Face Hub id{at})"


def _reason(exc: Exception, download_dir: str | None) -> str:
    """What went wrong, as a user can act on it."""
    from huggingface_hub import constants, errors

    cache = download_dir or constants.HF_HUB_CACHE
    if isinstance(exc, errors.GatedRepoError):
        return ("the repository is gated: accept its terms on its Hub page, then set HF_TOKEN (or run "
                "`hf auth login`) with a token of that account")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return "no such repository on the Hub, or it is private and no token with access to it is set (HF_TOKEN)"
    if isinstance(exc, errors.RevisionNotFoundError):
        return "the repository has no such revision (a branch, tag or commit)"
    if isinstance(exc, errors.IncompleteSnapshotError):
        return f"the cache at {cache} holds only part of it (an interrupted download?), and the Hub cannot complete it"
    if isinstance(exc, errors.LocalEntryNotFoundError):
        if _offline():
            return f"not in the Hugging Face cache at {cache}, and HF_HUB_OFFLINE=1 forbids downloading it"
        cause = exc.__cause__
        if isinstance(cause, errors.HfHubHTTPError) and cause.response is not None:
            return (f"not in the Hugging Face cache at {cache}, and the Hub answered HTTP "
                    f"{cause.response.status_code} when asked for it")
        return f"not in the Hugging Face cache at {cache}, and the Hub could not be reached to download it"
    if isinstance(exc, errors.HfHubHTTPError):
        return f"the Hub refused it: {_first_line(exc)}"
    return f"{type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [""])[0]
