"""Every relative link in the project's markdown resolves: the file it names exists, and its `#anchor`, if any,
is a heading of that file as GitHub names headings (lowercase; punctuation other than `-` and `_` dropped; each
space a `-`; a repeated heading gets `-1`, `-2`, ...). Links inside code (fenced blocks, `code spans`) are text,
not links, and are not checked."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.DOTALL)
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
HEADING = re.compile(r"^\s{0,3}(#{1,6})[ \t]+(.*?)[ \t#]*$", re.MULTILINE)
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")


def docs() -> list[Path]:
    """The markdown that is checked: the front door, the docs, the design and style notes, the deploy guides."""
    found = [REPO / "README.md", REPO / "DESIGN.md", REPO / "STYLE.md"]
    found += [REPO / "ftsup" / "store" / "DESIGN.md", REPO / "trainer" / "checkpoint" / "DESIGN.md"]
    found += sorted((REPO / "docs").rglob("*.md")) + sorted((REPO / "deploy").rglob("*.md"))
    return [path for path in found if path.is_file()]


def without_code(text: str) -> str:
    """The text with fenced blocks and code spans blanked out (newlines kept, so nothing else moves)."""
    blank = lambda m: re.sub(r"[^\n]", " ", m.group(0))  # noqa: E731
    return CODE_SPAN.sub(blank, FENCE.sub(blank, text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: the rendered text (a link's label, code without its backticks),
    lowercased, with everything but letters, digits, `_`, `-` and spaces dropped, and each space a `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor of a markdown file's headings, repeated headings numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    found = set()
    for match in HEADING.finditer(FENCE.sub("", path.read_text())):
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    """The targets of a file's inline and reference links."""
    text = without_code(path.read_text())
    return [m.group(1) for m in INLINE_LINK.finditer(text)] + [m.group(1) for m in REFERENCE_LINK.finditer(text)]


def broken_links(path: Path) -> list[str]:
    """`FILE: TARGET (why)` for each relative link of `path` that names no file, or no heading of it."""
    broken = []
    for target in links(path):
        if EXTERNAL.match(target):
            continue
        name, _, anchor = target.partition("#")
        dest = (path.parent / name).resolve() if name else path
        where = f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path.name}: {target}"
        if not dest.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and (dest.is_dir() or dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{where} (no such heading)")
    return broken


def test_every_relative_link_in_the_docs_resolves() -> None:
    assert [problem for path in docs() for problem in broken_links(path)] == []


def test_the_docs_hold_relative_links_to_check() -> None:
    relative = [t for path in docs() for t in links(path) if not EXTERNAL.match(t)]
    assert (len(docs()) >= 10, len(relative) >= 50) == (True, True)  # a pattern that matched nothing would pass


def test_a_link_to_a_missing_file_or_heading_is_reported(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## The `ftsup run` command: what it does\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "[fine](other.md) [fine too](other.md#the-ftsup-run-command-what-it-does) [second](other.md#twice-1)\n"
        "[here](#page) [gone](missing.md) [no heading](other.md#nowhere) [no third](other.md#twice-2)\n"
        "[not here](#elsewhere) [web](https://example.com/x#y) `[code](missing-too.md)`\n\n"
        "```\n[fenced](missing-three.md)\n```\n"
    )
    assert broken_links(page) == [
        "page.md: missing.md (no such file)",
        "page.md: other.md#nowhere (no such heading)",
        "page.md: other.md#twice-2 (no such heading)",
        "page.md: #elsewhere (no such heading)",
    ]


def test_a_heading_gets_githubs_anchor() -> None:
    headings = [
        "Goodput: where the job's time went",
        "`ftsup ckpt list DIR|s3://BUCKET/PREFIX [--json] [--deep]`",
        "Node-local fast tiers: each node its own `checkpoint.dir`",
        "See [the store](ftsup/store/DESIGN.md) first",
        "keep_last and keep_every",
    ]
    assert [slug(h) for h in headings] == [
        "goodput-where-the-jobs-time-went",
        "ftsup-ckpt-list-dirs3bucketprefix---json---deep",
        "node-local-fast-tiers-each-node-its-own-checkpointdir",
        "see-the-store-first",
        "keep_last-and-keep_every",
    ]
