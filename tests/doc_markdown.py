"""The parts of a Markdown page the doc checks read: fenced blocks, inline code, links and headings, each with the
line it starts on. A small reader of the subset the pages use (CommonMark's fences and code spans, GitHub's
heading anchors), not a renderer. No torch here."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FENCE = re.compile(r"^\s{0,3}(```+|~~~+)\s*([\w+-]*)")
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def pages() -> list[str]:
    """The pages the checks cover, found by glob: README.md and every topic page docs/*.md. Not docs/benchmarks/: a
    dated report keeps its commands as they ran that day."""
    return ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Fence:
    line: int  # the line of the first line inside the fence (1-based)
    info: str  # the language after the backticks: "bash", "json", "" ...
    lines: tuple[str, ...]


@dataclass(frozen=True)
class Span:
    line: int
    text: str  # the code span's content, a line break inside it read as a space


@dataclass(frozen=True)
class Page:
    name: str  # relative to the repository: "docs/tp.md"
    fences: tuple[Fence, ...]
    spans: tuple[Span, ...]  # inline code outside the fences
    prose: tuple[tuple[int, str], ...]  # (line, text) outside the fences, code spans still in


def read_page(name: str, text: str | None = None) -> Page:
    """The page `name` (relative to the repository), or `text` given as its content (the checks' own tests)."""
    lines = (ROOT / name).read_text().splitlines() if text is None else text.splitlines()
    fences: list[Fence] = []
    prose: list[tuple[int, str]] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        marker, start, body = m.group(1), i + 1, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(marker[0] * len(marker)):
            body.append(lines[i])
            i += 1
        fences.append(Fence(start + 1, m.group(2).lower(), tuple(body)))
        i += 1  # the closing fence
    return Page(name, tuple(fences), tuple(_spans(prose)), tuple(prose))


def _spans(prose: list[tuple[int, str]]) -> list[Span]:
    """Code spans, paragraph by paragraph: a span may run over a line break but not over a blank line. In a table
    row `\\|` is a `|` inside the span too (GitHub's rule)."""
    found: list[Span] = []
    paragraph: list[tuple[int, str]] = []
    for line, text in [*prose, (0, "")]:
        if text.strip():
            paragraph.append((line, text))
            continue
        if paragraph:
            starts, joined = [], ""
            for n, t in paragraph:
                starts.append((len(joined), n))
                joined += t + "\n"
            for m in CODE_SPAN.finditer(joined):
                n = max(line_no for offset, line_no in starts if offset <= m.start())
                content = m.group(2).replace("\n", " ").strip()
                found.append(Span(n, content.replace("\\|", "|")))
        paragraph = []
    return found


def without_code(text: str) -> str:
    """`text` with its code spans blanked out: what is left is prose, where links count."""
    return CODE_SPAN.sub(lambda m: " " * len(m.group(0)), text)


def links(page: Page) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link and image outside code."""
    return [(n, m.group(1)) for n, text in page.prose for m in LINK.finditer(without_code(text))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text in lower case, punctuation dropped (letters, digits, `_`,
    `-` and spaces kept), each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link reads as its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")  # HTML tags and code marks render as nothing
    text = re.sub(r"(\*+|(?<!\w)_+|_+(?!\w))", "", text)  # emphasis marks (an inner_underscore stays)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Page) -> set[str]:
    """Every heading's anchor on the page; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for _, text in page.prose:
        m = HEADING.match(text)
        if not m:
            continue
        base = slug(m.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found
