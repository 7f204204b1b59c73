"""The commands the pages show, found and parsed against today's flags by the entry points' own parsers.

What counts as a command: in a fenced block (not json/python/yaml/toml) every line, or, where a block has `$ `
prompts, only the prompted lines; and inline code that starts with one. A command is `python[3] -m <module> ...`,
`python[3] <script>.py ...` (any `.../python` too), `torchrun ...` (or `python -m torch.distributed.run`),
`bash run_*.sh ...`, or `bash -c '...'` holding those; env prefixes (`NPROC=2 ...`), `time`, `\\` continuations,
trailing `# comments`, `&&`, `;`, `|` and `for X in ...; do ...; done` are read as a shell would. Anything else
(pip, pytest, ruff, sbatch, a module of another package: venv, pytest) is not this repository's command line.

How each is parsed, by its own code, stopping before anything that would run, touch a file or need hardware:
* `train_*.py` (also under torchrun): the script runs until `common.cli.parse_config` returns, so every flag and
  `Config.check`'s value checks apply (nothing there reads a file), under torchrun with its world size.
* `bash run_*.sh`: the real script runs with PYTHON pointing at a stub that records what it is asked to run (so
  launch.sh's NPROC/NNODES/NODE_RANK checks, run_pippy.sh's and run_all.sh's own refusals apply; a PYTHON= of the
  page is overridden); each recorded `python -m runner.preflight ...` is then run in-process until it has parsed
  the flags and checked the layout for every world size, stopping at `check_gpus`, its first look at hardware:
  the memory, --out, --resume and data-set checks that follow depend on the machine and its files.
* any other `python -m <module>` or script of the repository: it runs until its argparse parser returns; checks
  it makes after that (e.g. the planner's --model-size) are not run. A module whose entry point has no argument
  parser is not run at all (it would just run): reported as skipped.
Bad input is SystemExit 2 or a UserError/ConfigError; a command that escapes (starts a process) fails too.

Placeholders: `<a|b>` and `NAME=a|b` are checked once per alternative; `[--flag value]` is checked with its
content, `[flags]` without it; a `...` word means "and more" and is dropped (`RUN...` reads RUN), except after a
flag (`--profile ...`), where it is that flag's value; `$NAME` takes the page's `NAME="..."`. Other placeholders
(`<out>`, an ALL-CAPS word such as RUN or MODE, `n`, that `...`) are passed as written: if the only complaint is
about one of them, the command is skipped (it needs a real value), not failed. Inline code
that is only a name (`python -m bench.machine`, no flags, no env) is checked for existence, not parsed.

A `$ ` command whose output shows `error: ...` is expected to fail with that line (`...` matches anything); if
the parse accepts it, the error comes from a later check (memory, files, another torch) and it passes. Commands
that an output line suggests after `: ` (`continue with: bash run_ddp.sh --resume`) are checked too."""

from __future__ import annotations

import argparse
import ast
import atexit
import contextlib
import functools
import importlib.util
import io
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from tests.doc_markdown import ROOT, Page, read_page

NOT_COMMANDS = ("json", "python", "py", "yaml", "toml", "jsonl")  # fenced languages that hold no command lines
# RUN, DIR, FILE.png, HOST:29500, <out>, n, and `...` where it stands for a flag's value
PLACEHOLDER = re.compile(r"^(<[^>]*>|[A-Z][A-Z0-9_]*([.:][\w.]*)?|n|\.\.\.)$")
ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PYTHON = re.compile(r"^(\S*/)?python3?(\.\d+)?$")
SUGGESTED = re.compile(r"(?<=: )((?:[A-Z][A-Z0-9_]*=\S+ )*(?:bash|python3?|torchrun) \S.*)$")


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    text: str  # as the page writes it, continuations joined
    inline: bool = False
    expected_error: str | None = None  # the `error: ...` line a `$ ` command's output shows


@dataclass(frozen=True)
class Outcome:
    command: Command
    shown: str  # the one command checked: an alternative, variables expanded
    status: str  # "ok", "name" (existence only), "skipped", "failed"
    message: str = ""

    def line(self) -> str:
        where = f"{self.command.page}:{self.command.line}"
        return f"{where}: `{self.shown}`: {self.message}" if self.message else f"{where}: `{self.shown}`"


# ---------------------------------------------------------------------------------------------- finding commands
def _strip_comment(text: str) -> str:
    """`text` up to a `#` that starts a word outside quotes (the shell's comment)."""
    quote = ""
    for i, c in enumerate(text):
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i].rstrip()
    return text.rstrip()


def _assignment(text: str) -> tuple[str, str] | None:
    """(NAME, value) when `text` is only a shell assignment, `F="--dropout 0 ..."`."""
    try:
        words = shlex.split(_strip_comment(text))
    except ValueError:
        return None
    if len(words) == 1 and re.match(r"^[A-Za-z_]\w*=", words[0]) and not text.lstrip().startswith("$"):
        name, value = words[0].split("=", 1)
        return name, value
    return None


def _joined(lines: tuple[str, ...], first: int) -> list[tuple[int, str]]:
    """(line, text) with `\\` continuations joined."""
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for i, text in enumerate(lines):
        if not pending:
            start = first + i
        if text.rstrip().endswith("\\"):
            pending += text.rstrip()[:-1] + " "
            continue
        out.append((start, pending + text))
        pending = ""
    if pending:
        out.append((start, pending))
    return out


def find_commands(page: Page) -> tuple[list[Command], dict[str, str]]:
    """The page's command candidates (a line of a fenced block, a code span) and its shell variables."""
    found: list[Command] = []
    variables: dict[str, str] = {}
    for fence in page.fences:
        if fence.info in NOT_COMMANDS:
            continue
        lines = _joined(fence.lines, fence.line)
        prompted = any(text.lstrip().startswith("$ ") for _, text in lines)
        for i, (n, text) in enumerate(lines):
            if (pair := _assignment(text.lstrip().removeprefix("$ "))) is not None:
                variables[pair[0]] = pair[1]
                continue
            if not prompted:
                found.append(Command(page.name, n, text.strip()))
                continue
            if not text.lstrip().startswith("$ "):
                if m := SUGGESTED.search(text.strip()):  # "continue with: bash run_ddp.sh ... --resume"
                    found.append(Command(page.name, n, m.group(1)))
                continue
            output = []
            for _, later in lines[i + 1 :]:
                if later.lstrip().startswith("$ "):
                    break
                output.append(later.strip())
            error = next((o for o in output if o.startswith("error:")), None)
            found.append(Command(page.name, n, text.strip()[2:], expected_error=error))
    for span in page.spans:
        if (pair := _assignment(span.text)) is not None:
            variables[pair[0]] = pair[1]
        elif _command_word(span.text) is not None:
            found.append(Command(page.name, span.line, span.text, inline=True))
    return found, variables


def _command_word(text: str) -> str | None:
    """The program `text` runs, if it is one this module checks: python, torchrun or bash."""
    try:
        words = shlex.split(_strip_comment(text).replace("|", " | "))
    except ValueError:
        return None
    words = [w for w in words if not ENV.match(w)]
    if words[:1] == ["time"]:
        words = words[1:]
    if not words:
        return None
    if PYTHON.match(words[0]) or words[0] in ("torchrun", "bash", "for"):
        return words[0]
    return None


# ------------------------------------------------------------------------------- from a line to argument lists
def _alternatives(text: str) -> list[str]:
    """`run_<ddp|fsdp>.sh` -> run_ddp.sh, run_fsdp.sh; `NODE_RANK=0|1` -> each; the rest as written."""
    m = re.search(r"<([\w.-]+(?:\|[\w.-]+)+)>", text) or re.search(r"(?<==)([\w.-]+(?:\|[\w.-]+)+)(?=\s|$)", text)
    if not m:
        return [text]
    return [
        alt for choice in m.group(1).split("|") for alt in _alternatives(text[: m.start()] + choice + text[m.end() :])
    ]


def _expand(text: str, variables: dict[str, str]) -> str:
    """The placeholder rules (module docstring) outside quotes, then $NAME from the page's variables."""
    parts = re.split(r"('[^']*'|\"[^\"]*\")", text)
    for i in range(0, len(parts), 2):  # (odd parts are quoted: code, a message, left as written)
        part = re.sub(r"\[(--[^\]]*)\]", r"\1", parts[i])  # [--shard-units blocks]: checked with it
        part = re.sub(r"\[[^\]-][^\]]*\]", "", part)  # [flags]: a placeholder for more flags
        part = re.sub(r"(?<=\w)\.\.\.(?=\s|$)", "", part)  # RUN... -> RUN
        parts[i] = re.sub(r"(?:(?<=\s)|^)\.\.\.(?=\s|$)", _elision, part)
    text = "".join(parts)
    return re.sub(r"\$\{?([A-Za-z_]\w*)\}?", lambda m: variables.get(m.group(1), m.group(0)), text)


def _elision(m: re.Match) -> str:
    """A `...` word: a flag's value where it follows a flag (`--profile ...`), else "and more", dropped."""
    before = m.string[: m.start()].split()
    return "..." if before and before[-1].startswith("--") and "=" not in before[-1] else ""


def segments(text: str, variables: dict[str, str]) -> list[list[str]]:
    """The simple commands in `text`, each as its words, after the placeholder rules (module docstring)."""
    out: list[list[str]] = []
    for alternative in _alternatives(_strip_comment(text)):
        lex = shlex.shlex(_expand(alternative, variables), posix=True, punctuation_chars=";&|")
        lex.whitespace_split, lex.commenters = True, ""
        try:
            words = list(lex)
        except ValueError:  # an unclosed quote: not a command line
            continue
        out.extend(_simple(words))
    return out


def _simple(words: list[str]) -> list[list[str]]:
    """Split at ; && || |, and unroll `for X in a b; do ...; done` (one command per value)."""
    parts: list[list[str]] = [[]]
    for w in words:
        if w in (";", "&&", "||", "|", "&"):
            parts.append([])
        else:
            parts[-1].append(w)
    parts = [p for p in parts if p]
    if parts and parts[0][:1] == ["for"] and len(parts[0]) >= 3 and parts[0][2] == "in":
        var, values = parts[0][1], parts[0][3:]
        body = [p[1:] if p[:1] == ["do"] else p for p in parts[1:] if p != ["done"]]
        unrolled = []
        for value in values:
            for p in body:
                unrolled.append([re.sub(rf"\${{?{var}}}?", value, w) for w in p])
        return unrolled
    return parts


# --------------------------------------------------------------------------------------- running the parsers
class _Parsed(BaseException):  # (not an Exception: an entry point's `except Exception` must not swallow it)
    """Raised where a command's parse is complete: what follows would run it."""


class _Escaped(BaseException):
    """Raised when an entry point starts a process or replaces this one: it ran past its parser."""


_LET_PARSE = [False]  # True while an entry point's own checks after argparse run (parse_config, the preflight)
_DEPTH = [0]  # argparse calls itself (parse_args -> parse_known_args): only the outermost parse stops


def _stop_after(real: Callable) -> Callable:
    def parse(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        _DEPTH[0] += 1
        try:
            result = real(self, *args, **kwargs)
        finally:
            _DEPTH[0] -= 1
        if _DEPTH[0] == 0 and not _LET_PARSE[0]:
            raise _Parsed()
        return result

    return parse


def _escaped(*args: object, **kwargs: object) -> None:
    raise _Escaped()


def _exit_raises(code: int) -> None:  # common.distributed.run ends with os._exit: here it must not end pytest
    raise SystemExit(code)


@contextlib.contextmanager
def _patched(target: object, name: str, value: object) -> Iterator[None]:
    old = getattr(target, name)  # (an AttributeError: an entry point renamed what this stops at; update this file)
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, old)


@contextlib.contextmanager
def _parse_only(argv0: str, args: list[str], env: dict[str, str], world_size: int | None) -> Iterator[None]:
    """argparse stops after parsing, nothing can start a process, os._exit raises, sys.argv and the env as given."""
    import common.cli

    real_parse_config = common.cli.parse_config

    def parse_config_then_stop(*a: object, **k: object) -> None:
        _LET_PARSE[0] = True
        try:
            if world_size is not None:  # under torchrun: the checks the workers make for their world size
                k.setdefault("world_size", world_size)
            real_parse_config(*a, **k)  # type: ignore[arg-type]
        finally:
            _LET_PARSE[0] = False
        raise _Parsed()

    with contextlib.ExitStack() as stack:
        for name in ("parse_args", "parse_known_args", "parse_intermixed_args", "parse_known_intermixed_args"):
            stack.enter_context(
                _patched(argparse.ArgumentParser, name, _stop_after(getattr(argparse.ArgumentParser, name)))
            )
        stack.enter_context(_patched(common.cli, "parse_config", parse_config_then_stop))
        for name in ("execv", "execve", "execvp", "execvpe", "system", "posix_spawn", "fork"):
            stack.enter_context(_patched(os, name, _escaped))
        stack.enter_context(_patched(subprocess, "Popen", _escaped))
        stack.enter_context(_patched(os, "_exit", _exit_raises))
        stack.enter_context(_patched(sys, "argv", [argv0, *args]))
        old_env = dict(os.environ)
        os.environ.update(env)
        stack.callback(lambda: (os.environ.clear(), os.environ.update(old_env)))
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy's "found in sys.modules": re-running is the point
        yield


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _warm_up(imports: list[str]) -> str | None:
    """Import what the entry point imports, outside the patches: an import that asks a subprocess (torch's does)
    must not count as the command starting one. None, or what failed to import."""
    for name in imports:
        try:
            importlib.import_module(name)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
    return None


@functools.cache
def _imports_of(path: Path) -> list[str]:
    """The modules of this repository that the file `path` imports at its top level."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
    return [name for name in found if _ours(name)]


def _run_parse(
    argv0: str, args: list[str], env: dict[str, str], call: Callable[[], None], world_size: int | None = None
) -> str | None:
    """None when `call` parsed `args` and stopped, else the one line that says what was wrong."""
    from common.errors import UserError

    err, out = io.StringIO(), io.StringIO()
    try:
        with _parse_only(argv0, args, env, world_size):
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
                call()
    except _Parsed:
        return None
    except _Escaped:
        return "started a process before its parser stopped it: cannot be checked without running it"
    except SystemExit as e:
        if e.code in (0, None):
            return None  # --help, or an entry point that had nothing to do
        return str(e.code) if isinstance(e.code, str) else _last_line(err.getvalue()) or f"exit status {e.code}"
    except UserError as e:
        return f"error: {e}"
    except Exception as e:  # an import error, a bug: the page's command cannot run
        return f"{type(e).__name__}: {e}"
    return "ran to its end without parsing its flags"


def _ours(module: str) -> bool:
    return (ROOT / module.split(".")[0] / "__init__.py").exists() or (ROOT / f"{module.split('.')[0]}.py").exists()


def _entry_file(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    if spec.submodule_search_locations:  # a package: `python -m` runs its __main__
        main = Path(spec.origin).parent / "__main__.py"
        return main if main.exists() else None
    return Path(spec.origin)


@functools.cache
def _has_parser(path: Path) -> bool:
    """Whether the entry file, or a module of the suite it imports (at top level, transitively), holds an argparse
    parser or parse_config: an entry point without one would not stop at a parse, it would run."""
    seen, todo = set(), [path]
    while todo:
        file = todo.pop()
        if file in seen:
            continue
        seen.add(file)
        if re.search(r"\bArgumentParser\b|\bparse_config\b", file.read_text()):
            return True
        todo += [f for name in _imports_of(file) if (f := _entry_file(name)) is not None and f.suffix == ".py"]
    return False


def _preflight(args: list[str]) -> Callable[[], None]:
    import runner.preflight

    def call() -> None:
        _LET_PARSE[0] = True  # parse_config for each world size, the layout: all before check_gpus
        try:
            with _patched(runner.preflight, "check_gpus", lambda *a, **k: _escaped_parsed()):
                runner.preflight.main(args)
        finally:
            _LET_PARSE[0] = False

    return call


def _escaped_parsed() -> None:
    raise _Parsed()


@functools.cache
def check_python(
    words: tuple[str, ...], env: tuple[tuple[str, str], ...], world_size: int | None = None
) -> tuple[str, str]:
    """(status, message) for `python <words>`: words[0] is `-m` with a module, or a script; `world_size`: the one
    torchrun gives it, for the training scripts' checks that depend on it."""
    if words[0] == "-c":
        return "skipped", "python -c: code, not a command line"
    if words[0] == "-m":
        if len(words) < 2:
            return "failed", "python -m without a module"
        module, args = words[1], list(words[2:])
        if module == "torch.distributed.run":
            return check_torchrun(tuple(args), env)
        if not _ours(module):
            return "other", ""
        entry = _entry_file(module)
        if entry is None:
            return "failed", f"no module {module} in this repository"
        is_package = entry.name == "__main__.py"
        if problem := _warm_up([*_imports_of(entry), module.split(".")[0] if is_package else module]):
            return "failed", problem
        if module == "runner.preflight":
            call = _preflight(args)
        elif not _has_parser(entry):
            return "skipped", f"{entry.relative_to(ROOT)} has no argument parser to stop at: it would run"
        else:
            call = lambda: runpy.run_module(module, run_name="__main__", alter_sys=False)  # noqa: E731
        problem = _run_parse(f"python -m {module}", args, dict(env), call, world_size)
        return ("failed", problem) if problem else ("ok", "")
    script, args = words[0], list(words[1:])
    path = ROOT / script
    if not script.endswith(".py"):
        return "other", ""
    if not path.exists():
        return "failed", f"no script {script} in this repository"
    if not _has_parser(path):
        return "skipped", f"{script} has no argument parser to stop at: it would run"
    if problem := _warm_up(_imports_of(path)):
        return "failed", problem
    call = lambda: runpy.run_path(str(path), run_name="__main__")  # noqa: E731
    problem = _run_parse(script, args, dict(env), call, world_size)
    return ("failed", problem) if problem else ("ok", "")


@functools.cache
def check_torchrun(words: tuple[str, ...], env: tuple[tuple[str, str], ...]) -> tuple[str, str]:
    """torchrun's own parser for its flags, then the script or module as `python` would get it."""
    from torch.distributed.run import get_args_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parsed = get_args_parser().parse_args(list(words))
    except SystemExit:
        return "failed", f"torchrun: {_last_line(err.getvalue())}"
    target = [parsed.training_script, *parsed.training_script_args]
    nproc, nnodes = str(parsed.nproc_per_node), str(parsed.nnodes).split(":")[-1]  # (an elastic MIN:MAX: its MAX)
    world_size = int(nproc) * int(nnodes) if nproc.isdigit() and nnodes.isdigit() else None
    return check_python(tuple(["-m", *target] if parsed.module else target), env, world_size)


_STUB = """#!/bin/sh
# what the runner asks PYTHON to run, recorded; run_all.sh's question about torch answered "cpu, has TP", its
# question about the pipeline's replicas (no torch) asked of the real Python
for a in "$@"; do printf '%s\\0' "$a" >> "$DOC_CHECK_LOG"; done
printf '%s\\0' --doc-check-end-- >> "$DOC_CHECK_LOG"
if [ "$1" = "-c" ]; then echo "cpu 1"; fi
if [ "$1" = "-m" ] && [ "$2" = "runner.layout" ]; then exec "$DOC_CHECK_PYTHON" "$@"; fi
"""


@functools.cache
def _stub() -> str:
    folder = tempfile.mkdtemp(prefix="doc-check-")
    atexit.register(shutil.rmtree, folder, True)
    path = os.path.join(folder, "python")
    with open(path, "w") as f:
        f.write(_STUB)
    os.chmod(path, 0o755)
    return path


@functools.cache
def check_runner(words: tuple[str, ...], env: tuple[tuple[str, str], ...]) -> tuple[str, str]:
    """`bash run_x.sh <words[1:]>`: the script itself with a stub PYTHON, then each preflight it asked for."""
    script = words[0]
    if not (ROOT / script).exists():
        return "failed", f"no {script} in this repository"
    with tempfile.NamedTemporaryFile(prefix="doc-check-", suffix=".log") as log:
        run_env = {**os.environ, **dict(env), "PYTHON": _stub(), "DOC_CHECK_LOG": log.name}
        run_env["DOC_CHECK_PYTHON"] = sys.executable
        done = subprocess.run(
            ["bash", script, *words[1:]], cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=60
        )
        if done.returncode != 0:
            return "failed", _last_line(done.stderr) or f"{script} exited {done.returncode}"
        recorded = Path(log.name).read_bytes().decode().split("\0")
    calls, current = [], []
    for word in recorded:
        if word == "--doc-check-end--":
            calls.append(current)
            current = []
        elif word or current:
            current.append(word)
    for call in calls:
        if call[:2] in (["-m", "runner.supervise"], ["-m", "runner.layout"]) or call[:1] == ["-c"]:
            continue  # the wrapper around torchrun (its flags came from the preflight's), and run_all.sh's question
        status, message = check_python(tuple(call), env)
        if status == "failed":
            return status, message
    return "ok", ""


def check_words(words: list[str], *, inline: bool) -> tuple[str, str]:
    """(status, message) for one simple command: status "ok", "name", "skipped", "failed", or "other" (not one
    this module checks)."""
    env = tuple((w.split("=", 1)[0], w.split("=", 1)[1]) for w in words if ENV.match(w) and "=" in w)
    rest = [w for w in words if not ENV.match(w)] if env else list(words)
    while rest[:1] == ["time"]:
        rest = rest[1:]
    if not rest:
        return "other", ""
    program, args = rest[0], rest[1:]
    only_a_name = inline and not env and len(args) <= (2 if args[:1] == ["-m"] else 1)
    if program == "bash":
        if args[:1] == ["-c"] and len(args) > 1:
            for inner in segments(args[1], {}):
                status, message = check_words(inner, inline=False)
                if status == "failed":
                    return status, message
            return "ok", ""
        if not args or not args[0].endswith(".sh"):
            return "other", ""
        if not re.fullmatch(r"run_\w+\.sh", args[0]):
            ok = (ROOT / args[0]).exists()
            return ("name", "") if ok else ("failed", f"no {args[0]} in this repository")
        if only_a_name:
            return ("name", "") if (ROOT / args[0]).exists() else ("failed", f"no {args[0]} in this repository")
        return check_runner(tuple(args), env)
    if program == "torchrun":
        if not args:
            return "skipped", "torchrun without a script"
        return check_torchrun(tuple(args), env)
    if PYTHON.match(program):
        if not args:
            return "other", ""
        if only_a_name:
            if args[0] == "-m":
                if not _ours(args[1]) or args[1] == "torch.distributed.run":
                    return "other", ""
                found = _entry_file(args[1]) is not None
                return ("name", "") if found else ("failed", f"no module {args[1]} in this repository")
            if args[0].endswith(".py"):
                found = (ROOT / args[0]).exists()
                return ("name", "") if found else ("failed", f"no script {args[0]} in this repository")
        return check_python(tuple(args), env)
    return "other", ""


def _about_placeholder(message: str, words: list[str]) -> str | None:
    """The placeholder of `words` that `message` complains about, if any."""
    for w in words:
        value = w.split("=", 1)[1] if ENV.match(w) else w
        if PLACEHOLDER.match(value) and re.search(rf"(?<![\w-]){re.escape(value)}(?![\w-])", message):
            return value
        if (inner := re.search(r"<[^>]*>", w)) and inner.group(0) in message:  # run_<strategy>.sh
            return inner.group(0)
    return None


def _matches(documented: str, message: str) -> bool:
    """The documented error line against today's: `...` (and `(...)`) match anything."""
    pattern = ".*".join(re.escape(part) for part in re.split(r"\(\.\.\.\)|\.\.\.", documented.strip()))
    return re.fullmatch(pattern, message.strip()) is not None


def check(command: Command, variables: dict[str, str]) -> list[Outcome]:
    """Every simple command in `command`, checked (status "other" ones left out)."""
    outcomes = []
    for words in segments(command.text, variables):
        shown = shlex.join(words)
        status, message = check_words(words, inline=command.inline)
        if status == "other":
            continue
        if status == "failed" and (placeholder := _about_placeholder(message, words)):
            status, message = "skipped", f"needs a real value for the placeholder {placeholder}"
        if command.expected_error is not None and status in ("ok", "failed"):
            if status == "ok":
                message = "its documented error comes from a check after the parse"
            elif not message.startswith("error:"):
                message = f"error: {message}"
            if status == "failed":
                same = _matches(command.expected_error, message)
                status = "ok" if same else "failed"
                message = "fails as documented" if same else f"documented `{command.expected_error}`, today `{message}`"
        outcomes.append(Outcome(command, shown, status, message))
    return outcomes


def check_page(name: str, text: str | None = None) -> list[Outcome]:
    """Every command on the page `name` (relative to the repository; `text`: its content instead of the file's)."""
    commands, variables = find_commands(read_page(name, text))
    return [outcome for command in commands for outcome in check(command, variables)]


def summary(outcomes: list[Outcome]) -> str:
    counts = {s: sum(o.status == s for o in outcomes) for s in ("ok", "name", "skipped", "failed")}
    return (
        f"{counts['ok'] + counts['failed']} commands parsed ({counts['failed']} failed), "
        f"{counts['name']} named only, {counts['skipped']} skipped"
    )
