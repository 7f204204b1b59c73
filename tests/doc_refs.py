"""What the pages name, checked against the repository: code symbols, file paths, links and their anchors.

* `module.symbol` (e.g. `common.clipping.clip_grad_norm`, `planner.timing.predict_time_s`, a trailing `()` or
  `(...)` allowed) whose first part is a package or a top-level module of the suite imports, and has that attribute.
  `Class.attr`, where Class is defined once in the suite, has it (`Checkpoints.start`).
* A bare backticked `snake_case_name` (an underscore in it) must be defined in the suite (a function, class, method,
  constant), or be a name its code uses (an attribute, an argument, a torch API it calls, a key it writes as a
  string, a word of a shell script): `save_checkpoint` fails once nothing defines or uses it.
* A backticked path (`common/checkpoint.py`, `docs/tp.md`, `bench/`) whose first part is a tracked top-level entry
  exists, and so does a bare source or doc file name (`train_ddp.py`, `*.py`, `*.sh`, `*.md`, `*.txt`, `*.toml`)
  anywhere in the repository; `:12` line suffixes are dropped. Not checked: outputs (`runs/...`, a bare `run.json`,
  `metrics.jsonl`, `model.pt`, `*.png`), absolute paths, and paths with a placeholder (`<`, `*`, `{`, `...`, `YYYY`).
* A relative link or image resolves to a file; its `#anchor` is a heading of the target page (GitHub's slugs).
* In a ```python block, each `import` / `from ... import` of the suite's modules resolves (the block is not run).
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
import subprocess

from tests.doc_markdown import ROOT, Page, anchors, links, read_page

SYMBOL = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(.*\))?$")
BARE = re.compile(r"^([a-z][a-z0-9]*(?:_[a-z][a-z0-9]*)+)(?:\(.*\))?$")  # (not step_0000015, a folder)
PATH = re.compile(r"^\.?[\w.-]+(?:/[\w.-]*)*$")
SOURCE_FILE = re.compile(r"\.(py|sh|md|txt|toml|ini|sbatch|cfg)$")
OWN = ("tests/doc_", "tests/unit/test_docs.py")
FILE_NAME = re.compile(r"\.(py|sh|md|txt|toml|ini|sbatch|cfg|json|jsonl|pt|png|csv|log|html)$")  # a file, not a symbol


@functools.cache
def tracked() -> tuple[str, ...]:
    """The repository's files, as git knows them, and the untracked ones being written now (not ignored)."""
    done = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True
    )
    return tuple(line for line in done.stdout.splitlines() if (ROOT / line).exists())


@functools.cache
def _packages() -> frozenset[str]:
    """The suite's top-level packages and modules: `common`, `planner`, ..., `train_ddp`."""
    tops = {p.split("/")[0] for p in tracked() if p.endswith("/__init__.py") and p.count("/") == 1}
    return frozenset(tops | {p[:-3] for p in tracked() if "/" not in p and p.endswith(".py")})


@functools.cache
def _python_names() -> tuple[dict[str, set[str]], frozenset[str]]:
    """(class name -> the modules defining it, every name the suite's code defines or uses)."""
    classes: dict[str, set[str]] = {}
    names: set[str] = set()
    for path in tracked():
        if path.endswith(".sh") or path.endswith(".sbatch"):
            names.update(re.findall(r"\w+", (ROOT / path).read_text()))
        if not path.endswith(".py") or path.startswith(OWN):  # (the doc checks name stale symbols on purpose)
            continue
        module = path[:-3].replace("/", ".").removesuffix(".__init__")
        try:
            tree = ast.parse((ROOT / path).read_text())
        except SyntaxError:  # a file being edited right now: its names are not known this time
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, set()).add(module)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.keyword) and node.arg:
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.update(node.name.split("."))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                names.add(node.value)  # a key of metrics.jsonl or run.json, written as a string
    return classes, frozenset(names)


def _resolve(dotted: str) -> str | None:
    """None when `dotted` (a.b.c) imports as a module plus attributes, else what is missing."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            found: object = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and module.startswith(e.name) and cut > 1:  # this prefix is not a module: try a shorter one
                continue
            return f"cannot import {module}: {e}"
        except Exception as e:
            return f"cannot import {module}: {type(e).__name__}: {e}"
        for i, attr in enumerate(parts[cut:], start=cut):
            if not hasattr(found, attr) and attr not in getattr(found, "__dataclass_fields__", {}):
                return f"{'.'.join(parts[:i])} has no {attr}"
            found = getattr(found, attr, None)
        return None
    return f"no module {parts[0]}"


def check_symbol(text: str) -> str | None:
    """None when the code span `text` names something that exists (or is not a name of the suite's), else why not."""
    m = SYMBOL.match(text)
    if m and "/" not in text and not FILE_NAME.search(text):
        dotted = m.group(1)
        first = dotted.split(".")[0]
        if first in _packages():
            return _resolve(dotted)
        classes, _ = _python_names()
        if len(classes.get(first, ())) == 1 and dotted.count(".") == 1:
            (module,) = classes[first]
            return _resolve(f"{module}.{dotted}")
        return None
    m = BARE.match(text)
    if m and m.group(1) not in _python_names()[1]:
        return f"{m.group(1)}: nothing in the code defines or uses this name"
    return None


def check_path(text: str) -> str | None:
    """None when the code span `text` is a repository path that exists (or is not one this checks), else why not."""
    path = re.sub(r":\d+(-\d+)?$", "", text.strip())
    if not PATH.match(path) or path.startswith(("runs/", "/", "~")) or "..." in path or "YYYY" in path:
        return None
    if "/" not in path:
        if not SOURCE_FILE.search(path) or "." not in path or path.count(".") > 1 and not path.startswith("."):
            return None
        names = {p.rsplit("/", 1)[-1] for p in tracked()}
        return None if path in names else f"no file {path} in the repository"
    first = path.split("/")[0]
    tops = {p.split("/")[0] for p in tracked()}
    if first not in tops:
        return None  # not a path of the repository: an output, another package's file
    return None if (ROOT / path).exists() else f"no {path} in the repository"


def check_links(page: Page) -> list[tuple[int, str]]:
    """(line, problem) for each relative link or image that does not resolve, or whose #anchor is no heading."""
    problems = []
    base = (ROOT / page.name).parent
    for line, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        file, _, anchor = target.partition("#")
        path = (base / file).resolve()
        if file and not path.exists():
            problems.append(
                (line, f"link {target}: no {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
            )
            continue
        if not anchor or path.suffix != ".md" and file:
            continue
        target_page = read_page(path.relative_to(ROOT).as_posix()) if file else page
        if anchor not in anchors(target_page):
            problems.append((line, f"link {target}: no heading with the anchor #{anchor} in {file or page.name}"))
    return problems


def check_imports(page: Page) -> list[tuple[int, str]]:
    """(line, problem) for each import of the suite's modules in a ```python block that does not resolve."""
    problems = []
    for fence in page.fences:
        if fence.info not in ("python", "py"):
            continue
        try:
            tree = ast.parse("\n".join(fence.lines))
        except SyntaxError:  # an excerpt with `...` in it: nothing to resolve
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                dotted = [f"{node.module}.{a.name}" for a in node.names if a.name != "*"]
            elif isinstance(node, ast.Import):
                dotted = [a.name for a in node.names]
            else:
                continue
            for name in dotted:
                if name.split(".")[0] in _packages() and (problem := _resolve(name)) is not None:
                    problems.append((fence.line + node.lineno - 1, f"import {name}: {problem}"))
    return problems


def check_page_refs(page: Page) -> list[tuple[int, str]]:
    """(line, problem) for every symbol, path, link and import of the page that does not resolve."""
    problems = []
    for span in page.spans:
        for check in (check_symbol, check_path):
            if (problem := check(span.text)) is not None:
                problems.append((span.line, f"`{span.text}`: {problem}"))
    return problems + check_links(page) + check_imports(page)
