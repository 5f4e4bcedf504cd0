"""The docs reference only what exists: every repository path they name, every relative Markdown link and
its `#anchor`, and every result file named in the benchmark docs. Runs on the text alone (no imports of
the package), so a doc edit that breaks a link fails here rather than in a reader's browser."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

# Reference docs: what is true now. CHANGELOG.md is history and may name files that are gone; only its
# Markdown links are checked.
REFERENCE_DOCS = sorted(
    [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "benchmarks").rglob("README.md")],
    key=str,
)
LINKED_DOCS = [*REFERENCE_DOCS, ROOT / "CHANGELOG.md"]
# Docs whose bare result names (`e2e-collect-s9c.json`) must be files under benchmarks/results/.
RESULT_NAMING_DOCS = [
    ROOT / "README.md",
    ROOT / "docs" / "performance.md",
    ROOT / "benchmarks" / "probes" / "README.md",
    RESULTS / "README.md",
]

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
PATH = re.compile(r"(?<![\w./-])((?:docs|benchmarks|tests|moe_attrib)/[\w./{}<>*,-]*[\w*}>/])")
RESULT_NAME = re.compile(r"`([\w{}<>*,./-]+\.(?:json|txt|log|npz))`")
OUTPUT_FLAG = re.compile(r"(?:--out|--markdown_out|>)\s*$")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _pattern(text: str) -> re.Pattern:
    """A path as written in a doc, as a regex: `*` and `<name>` are one path segment's characters,
    `{a,b}` is either."""
    out = re.escape(text)
    out = re.sub(r"<[^>]*>", "[^/]+", out)
    out = out.replace(r"\*", "[^/]*")
    out = re.sub(r"\\\{([^}]*)\\\}", lambda m: "(?:" + "|".join(m.group(1).replace("\\", "").split(",")) + ")", out)
    return re.compile(out + "$")


def _exists(path: str, base: Path) -> bool:
    path = path.rstrip("/")
    if not any(c in path for c in "*<{"):
        return (base / path).exists()
    fixed = re.split(r"[*<{]", path)[0].rpartition("/")[0]
    pattern = _pattern(path)
    return any(pattern.match(str(p.relative_to(base))) for p in (base / fixed).rglob("*"))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    in_code = False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        slug = _slug(line.lstrip("#"))
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _without_links(text: str) -> str:
    return LINK.sub(lambda m: m.group(0).split("](")[0] + "]", text)


@pytest.mark.parametrize("doc", LINKED_DOCS, ids=_rel)
def test_markdown_links_resolve(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {_rel(dest)}")
    assert not broken, f"{_rel(doc)}: " + "; ".join(broken)


@pytest.mark.parametrize("doc", REFERENCE_DOCS, ids=_rel)
def test_named_paths_exist(doc):
    text = _without_links(doc.read_text())
    missing = []
    for match in PATH.finditer(text):
        if OUTPUT_FLAG.search(text[max(0, match.start() - 12) : match.start()]):
            continue  # a file the command writes
        if not _exists(match.group(1), ROOT):
            missing.append(match.group(1))
    assert not missing, f"{_rel(doc)} names paths that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", RESULT_NAMING_DOCS, ids=_rel)
def test_named_result_files_exist(doc):
    text = doc.read_text()
    missing = []
    for match in RESULT_NAME.finditer(text):
        if OUTPUT_FLAG.search(text[max(0, match.start() - 12) : match.start()]):
            continue
        name = match.group(1).removeprefix("benchmarks/results/")
        if (ROOT / name).exists():
            continue  # a repository file such as constraints.txt
        pattern = _pattern(name)
        if not any(pattern.match(str(p.relative_to(RESULTS))) or pattern.match(p.name) for p in RESULTS.rglob("*")):
            missing.append(name)
    assert not missing, f"{_rel(doc)} names result files that are not in benchmarks/results/: {sorted(set(missing))}"


def test_results_index_lists_every_result_file():
    """benchmarks/results/README.md names every file kept there (by name, pattern or folder)."""
    index = (RESULTS / "README.md").read_text()
    names = {m.group(1) for m in re.finditer(r"`([^`\s]+)`", index)}
    patterns = [_pattern(n.rstrip("/")) for n in names]
    unlisted = [
        _rel(p)
        for p in sorted(RESULTS.rglob("*"))
        if p.is_file()
        and p.name != "README.md"
        and not any(
            pat.match(str(p.relative_to(RESULTS))) or pat.match(p.name) or pat.match(str(p.parent.relative_to(RESULTS)))
            for pat in patterns
        )
    ]
    assert not unlisted, f"benchmarks/results/README.md does not list: {unlisted}"
