"""The docs stay readable: a short README, no wall-of-text lines, links that resolve, every page in the site's nav.

`mkdocs build --strict` (in `.ci/run`) checks the links between pages of the site; these checks also cover the README,
which is not part of the site, and run without mkdocs installed.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MKDOCS = ROOT / "mkdocs.yml"

MAX_README_LINES = 300
MAX_LINE_CHARS = 400

# [text](target) outside code; images too. Targets with a scheme (http:, mailto:) or starting with '#'-only are
# handled separately.
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"`[^`]*`")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans removed (links inside code are not links)."""
    out, in_fence = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            out.append(_CODE_SPAN.sub("", line))
    return out


def slugify(heading: str) -> str:
    """Python-Markdown's toc slug (what mkdocs uses for anchors): drop markup, lowercase, keep word chars and hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path: Path) -> set[str]:
    """Every heading's slug, numbered as Python-Markdown numbers duplicates (slug, slug_1, ...)."""
    seen: dict[str, int] = {}
    result = set()
    for line in _heading_lines(path):
        match = _HEADING.match(line)
        if not match:
            continue
        slug = slugify(match.group(2))
        count = seen.get(slug, 0)
        result.add(slug if count == 0 else f"{slug}_{count}")
        seen[slug] = count + 1
    return result


def _heading_lines(path: Path) -> list[str]:
    out, in_fence = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence:
            out.append(line)
    return out


def relative_links(path: Path) -> list[str]:
    links = []
    for line in prose_lines(path.read_text(encoding="utf-8")):
        for target in _LINK.findall(line):
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            links.append(target)
    return links


def nav_pages() -> set[str]:
    """The .md files mkdocs.yml's nav names (a plain scan: every `Title: page.md` entry below `nav:`)."""
    text = MKDOCS.read_text(encoding="utf-8")
    nav = text.split("\nnav:", 1)
    assert len(nav) == 2, "mkdocs.yml has no nav"
    return set(re.findall(r":\s*([\w./-]+\.md)\s*$", nav[1], flags=re.MULTILINE))


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move detail into docs/ (limit {MAX_README_LINES})"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_line_is_a_wall_of_text(path: Path) -> None:
    long = [(n, len(line)) for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if len(line) > MAX_LINE_CHARS]
    assert not long, f"{path.relative_to(ROOT)}: lines over {MAX_LINE_CHARS} characters (line, length): {long}"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading with anchor #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{path.relative_to(ROOT)}: broken links: {broken}"


def test_every_docs_page_is_in_the_nav() -> None:
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    nav = nav_pages()
    assert pages, "docs/ has no pages"
    assert not pages - nav, f"docs pages missing from mkdocs.yml's nav: {sorted(pages - nav)}"
    assert not nav - pages, f"mkdocs.yml's nav names pages that do not exist: {sorted(nav - pages)}"


def test_the_index_and_the_readme_lead_to_the_pages() -> None:
    """A reader finds every page from docs/index.md, and the README points into the docs."""
    from_index = {t.partition("#")[0] for t in relative_links(DOCS / "index.md")}
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")} - {"index.md"}
    assert not pages - from_index, f"pages not linked from docs/index.md: {sorted(pages - from_index)}"
    from_readme = {t.partition("#")[0] for t in relative_links(README)}
    assert "docs/index.md" in from_readme and "docs/benchmarks.md" in from_readme


def test_the_checks_catch_what_they_guard(tmp_path: Path) -> None:
    """The helpers above see a broken link, a missing anchor and a long line (so the tests cannot pass by accident)."""
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## A `code` heading\n\n[ok](#a-code-heading) [bad](#nope) [gone](missing.md)\n"
                    "`[not a link](nowhere.md)`\n" + "x" * (MAX_LINE_CHARS + 1) + "\n", encoding="utf-8")
    assert anchors(page) == {"title", "a-code-heading"}
    assert relative_links(page) == ["#a-code-heading", "#nope", "missing.md"]
    assert max(len(line) for line in page.read_text().splitlines()) > MAX_LINE_CHARS
    assert slugify("`PipelineEngine.save_16bit_model`") == "pipelineenginesave_16bit_model"
