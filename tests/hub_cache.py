"""Hugging Face Hub caches for tests, laid out where huggingface_hub looks (HF_HOME/hub) as its downloads
leave them: content-addressed blobs, one snapshot folder of links per commit, a ref per branch. No test
can reach the Hub; the layout is checked with huggingface_hub's own cache scanner."""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import os
import threading
from pathlib import Path

from huggingface_hub import scan_cache_dir
from huggingface_hub.file_download import repo_folder_name


def commit_of(name: str) -> str:
    """A 40-hex commit id, the same for the same name."""
    return hashlib.sha1(name.encode()).hexdigest()


def add_to_hub_cache(cache: Path, repo_id: str, revisions: dict[str, Path]) -> dict[str, Path]:
    """Put each local model directory in the cache as the repository's branch of that name; returns each
    branch's snapshot folder."""
    storage = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    snapshots = {}
    for branch, source in revisions.items():
        commit = commit_of(f"{repo_id}@{branch}")
        snapshot = storage / "snapshots" / commit
        for file in sorted(p for p in source.rglob("*") if p.is_file()):
            data = file.read_bytes()
            blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            link = snapshot / file.relative_to(source)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        (storage / "refs" / branch).write_text(commit)
        snapshots[branch] = snapshot
    repo = next(r for r in scan_cache_dir(cache).repos if r.repo_id == repo_id)  # as huggingface_hub reads it
    assert {ref for rev in repo.revisions for ref in rev.refs} == set(revisions), repo
    return snapshots


class _Refusing(http.server.BaseHTTPRequestHandler):
    """Answers every request as the Hub answers one it refuses: a status and its X-Error-Code."""
    status, code = 404, "RepoNotFound"

    def do_GET(self):
        self.send_response(self.status)
        self.send_header("X-Error-Code", self.code)
        self.send_header("X-Error-Message", f"{self.code} (a test's Hub)")
        self.send_header("Content-Type", "application/json")
        body = json.dumps({"error": f"{self.code} (a test's Hub)"}).encode()
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def refusing_hub(status: int, code: str):
    """The URL of a local stand-in for the Hub that refuses everything as `code` (HF_ENDPOINT)."""
    handler = type("Handler", (_Refusing,), {"status": status, "code": code})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
