"""The repository explains itself: its Markdown links resolve, the files and modules the docs name
exist, the README stays short, and nothing points outside the repository at a design note a clone
does not have."""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 200
OUTSIDE_NOTE = "../" + "shared"  # spelt in two pieces, so that this file does not mention it

FENCED = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1", re.DOTALL | re.MULTILINE)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)
# A repository path: a known top-level folder, then names (a glob's * too), as `shared/request.py`,
# `services/*/options.py` or `services/worker/attention/`. Not after a word, a dot, a slash or ~, so that
# a URL's or a home folder's inner parts (https://host/docs/x, ~/.cache/pagedserve) are not taken for one.
TOP_FOLDERS = ("services", "shared", "pagedserve", "tests", "benchmarks", "protos", "docs", "deploy", r"\.ci")
REPO_PATH = re.compile(r"(?<![\w./~-])((?:" + "|".join(TOP_FOLDERS) + r")/(?:[\w.*-]*[\w*]/?)*)")
MODULE_RUN = re.compile(r"python3? -m ((?:" + "|".join(TOP_FOLDERS) + r")(?:\.\w+)+)")  # python -m shared.x.y
FILE_NAME = re.compile(r"`([\w-]+\.py)`")  # a module named alone, as `scheduler.py` beside its folder


def prose(text: str) -> str:
    """The Markdown without code, where brackets are not links."""
    return INLINE_CODE.sub("", FENCED.sub("", text))


def anchor(heading: str) -> str:
    """GitHub's id for a heading: lowercase, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCED.sub("", path.read_text(encoding="utf-8"))
    return {anchor(heading.replace("`", "")) for heading in HEADING.findall(text)}


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in LINK.findall(prose(path.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:: not a file here
            continue
        file_part, _, fragment = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(f"{target}: no heading #{fragment} in {linked.name}")
    return broken


def repository_files() -> list[Path]:
    """The files a clone has (tracked), and new ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode()
    return [REPO / name for name in listed.split("\0") if name]


def exists(path: str, root: Path = REPO) -> bool:
    return any(root.glob(path.rstrip("/"))) if "*" in path else (root / path).exists()


@functools.cache
def repository_file_names() -> frozenset[str]:
    return frozenset(path.name for path in repository_files())


def missing_paths(text: str, root: Path = REPO, file_names: frozenset[str] | None = None) -> list[str]:
    """What the text names in the repository (paths from its root, modules run with python -m, files named
    alone) that is not there."""
    names = repository_file_names() if file_names is None else file_names
    missing = [path for path in REPO_PATH.findall(text) if not exists(path, root)]
    missing += [module for module in MODULE_RUN.findall(text)
                if not (exists(module.replace(".", "/") + ".py", root) or exists(module.replace(".", "/"), root))]
    return missing + [name for name in FILE_NAME.findall(text) if name not in names]


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(REPO)))
def test_named_paths_exist(doc):
    """A file, folder or module the docs name is there: a move that forgets the docs fails here."""
    assert missing_paths(doc.read_text(encoding="utf-8")) == [], f"{doc.relative_to(REPO)} names what is not there"


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(REPO)))
def test_relative_links_resolve(doc):
    assert broken_links(doc) == [], f"{doc.relative_to(REPO)} has broken links"


def test_the_docs_pages_exist():
    assert {"architecture.md", "api.md", "deployment.md", "models.md", "operations.md", "performance.md"} <= {
        path.name for path in DOCS}


def test_readme_is_short():
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_readme_keeps_the_command_ci_runs():
    ci_command = (REPO / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1]
    assert ci_command in (REPO / "README.md").read_text(encoding="utf-8").splitlines()


def test_nothing_points_outside_the_repository():
    mentions = [str(path.relative_to(REPO)) for path in repository_files()
                if path.is_file() and OUTSIDE_NOTE.encode() in path.read_bytes()]
    assert mentions == [], f"these files refer to {OUTSIDE_NOTE}, which a clone does not have"


def test_the_link_checker_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# Is here\n", encoding="utf-8")
    page.write_text("[ok](there.md#is-here) [gone](missing.md) [bad](there.md#not-here) `[code](missing.md)`\n"
                    "```\n[fenced](missing.md)\n```\n[web](https://example.com/x)\n", encoding="utf-8")
    assert broken_links(page) == ["missing.md: no such file", "there.md#not-here: no heading #not-here in there.md"]


def test_the_path_checker_sees_a_missing_path(tmp_path):
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "here.py").write_text("", encoding="utf-8")
    text = ("`shared/here.py` `shared/*.py` `shared/gone.py` `python -m shared.here` `python -m shared.gone`\n"
            "`here.py` `gone.py`, and (services/moved/) in prose.\n"
            "Not paths: https://example.com/shared/x.py, ~/.cache/pagedserve/x, sm_80/sm_90, /v1/models.\n")
    assert missing_paths(text, tmp_path, frozenset({"here.py"})) == [
        "shared/gone.py", "services/moved/", "shared.gone", "gone.py"]
