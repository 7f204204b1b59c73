"""What tests/unit/test_docs.py checks, as a report: every page's count of commands and each failure, one line each.

    python -m tests.doc_check                  # README.md and every docs/*.md
    python -m tests.doc_check docs/tp.md       # one page (or several)

Exit status 1 when anything fails. The rules: tests/doc_commands.py (commands), tests/doc_refs.py (names, paths,
links)."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from tests.doc_markdown import ROOT, pages, read_page


def report(page: str) -> list[str]:
    """The page's summary line, then one line per failure (and per command skipped, marked so)."""
    from tests.doc_commands import check_page, summary
    from tests.doc_refs import check_page_refs

    outcomes = check_page(page)
    refs = check_page_refs(read_page(page))
    lines = [f"== {page}: {summary(outcomes)}; {len(refs)} names, paths or links that do not resolve"]
    lines += [f"FAILED {o.line()}" for o in outcomes if o.status == "failed"]
    lines += [f"FAILED {page}:{line}: {problem}" for line, problem in refs]
    lines += [f"skipped {o.line()}" for o in outcomes if o.status == "skipped"]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.doc_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("pages", nargs="*", help="pages to check (default: README.md and docs/*.md)")
    args = parser.parse_args(argv)
    missing = [p for p in args.pages if not (ROOT / p).is_file()]
    if missing:
        print(f"error: pages: no {', '.join(missing)}; give paths like docs/tp.md", file=sys.stderr)
        return 2
    failed = False
    for page in args.pages or pages():
        lines = report(page)
        failed = failed or any(line.startswith("FAILED") for line in lines)
        print("\n".join(lines), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
