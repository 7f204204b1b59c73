"""What a copy of a script carries, read from the sources: the common/ modules each training script loads (the
closure of module-level imports) and their lines, the scripts' and their functions' lengths, wraps that import
nothing of the suite, the worker package apart from the runners and the tools, no import cycle, and the runners'
checks free of torch."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ("train_ddp.py", "train_fsdp.py", "train_pippy.py", "train_tp.py", "train_cp.py", "train_ep.py")
# The packages no training process imports: the runners' side, the tools, the planner and the benchmark
NOT_WORKER = ("runner", "tools", "planner", "bench")
# Lines of common/ behind train_ddp.py (nanoGPT's train.py needs ~380, the FSDP2 example ~370). 1,500 is the aim.
# What a run needs only with a flag loads only then: fp16's loss scaling (common/fp16.py), resuming (common/resume.py),
# the ViT and its sizes (common/vit.py, common/vit_sizes.py), the optional features' checks (optional_checks.py).
# The installed torch's check (common/versions.py) loads inside Config.check: a copy drops those three lines, no loss.
# What stays above the aim is what every run uses: the interruptions a user meets (preemption, write errors, timeouts,
# out of memory, one line each), checkpoints and run.json, and every script's flags (the ViT's, BabyGPT's and the other
# strategies' too, for --help and the checks: train_cp.py's --cp-attention, default model, --tp refusal added 12; the
# mixture of experts' six flags, the published ones' defaults and train_ep.py's routing record, 42); docs/copying.md
# says which lines of them a copier needs.
DDP_BUDGET = 1777
SCRIPT_LINES = {"train_pippy.py": 280}  # the others: 220
LONGEST_FUNCTION = {"train_pippy.py": 130}  # the others: 90
# Each script's wrap, copyable alone: these functions use no name the script imports from the suite
WRAPS = {
    "train_ddp.py": ("apply_ddp",),
    "train_fsdp.py": ("fsdp_mesh", "apply_fsdp"),
    "train_tp.py": ("ReplicateParallel", "apply_tp"),
    "train_pippy.py": ("apply_pipeline", "make_schedule"),
    "train_cp.py": ("apply_cp", "cut_sequences"),
    "train_ep.py": ("apply_ep",),
}


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def imports(path: Path, *, module_level: bool) -> set[str]:
    """The modules `path` imports: at module level only (what importing it runs), or anywhere in it."""
    tree = ast.parse(path.read_text())
    if module_level:
        nodes, todo = [], list(tree.body)
        while todo:  # statements that run on import: not a function's body, not `if TYPE_CHECKING:`
            node = todo.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or _is_type_checking(node):
                continue
            nodes.append(node)
            for field in ("body", "orelse", "finalbody", "handlers"):
                todo += getattr(node, field, [])
    else:
        nodes = list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def source(module: str) -> Path:
    return ROOT / (module.replace(".", "/") + ".py")


def closure(path: Path, ours: tuple[str, ...] = ("common.",)) -> set[str]:
    """The modules of the packages `ours` that importing `path` loads."""
    seen: set[str] = set()
    todo = [m for m in imports(path, module_level=True) if m.startswith(ours)]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += [m for m in imports(source(module), module_level=True) if m.startswith(ours)]
    return seen


def lines(modules: set[str]) -> int:
    return sum(len(source(m).read_text().splitlines()) for m in modules)


def test_train_ddp_carries_a_small_library():
    modules = closure(ROOT / "train_ddp.py")
    sizes = {m: lines({m}) for m in sorted(modules)}
    assert lines(modules) <= DDP_BUDGET, sizes
    assert {"common.recorder", "common.checkpoint", "common.data", "common.distributed"} <= modules  # it reads them


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_reads_in_one_sitting(script):
    tree = ast.parse((ROOT / script).read_text())
    assert len((ROOT / script).read_text().splitlines()) <= SCRIPT_LINES.get(script, 220)
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    longest = max(functions, key=lambda n: n.end_lineno - n.lineno)
    assert longest.end_lineno - longest.lineno + 1 <= LONGEST_FUNCTION.get(script, 90), longest.name


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_wrap_uses_nothing_of_the_suite(script):
    """The wrap a reader copies needs torch and the arguments it is given: no name the script imports from common."""
    tree = ast.parse((ROOT / script).read_text())
    ours = {
        alias.asname or alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("common")
        for alias in node.names
    }
    wraps = [n for n in tree.body if getattr(n, "name", None) in WRAPS[script]]
    assert len(wraps) == len(WRAPS[script])
    for wrap in wraps:
        used = {n.id for n in ast.walk(wrap) if isinstance(n, ast.Name)}
        assert not used & ours, f"{wrap.name} uses {used & ours} of the suite"


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_worker_module_imports_the_runners_or_the_tools(script):
    for module in [script.removesuffix(".py"), *closure(ROOT / script)]:
        path = ROOT / script if module == script.removesuffix(".py") else source(module)
        found = {m for m in imports(path, module_level=False) if m.split(".")[0] in NOT_WORKER}
        assert not found, f"{module} imports {found}"


def test_the_worker_package_imports_only_itself():
    for path in sorted((ROOT / "common").glob("*.py")):
        found = {m for m in imports(path, module_level=False) if m.split(".")[0] in NOT_WORKER}
        assert not found, f"{path.name} imports {found}"


def test_no_import_cycle_in_the_worker_package():
    """Imports anywhere in a module count, inside functions too: none may close a cycle."""
    graph = {
        f"common.{p.stem}": {m for m in imports(p, module_level=False) if m.startswith("common.")}
        for p in (ROOT / "common").glob("*.py")
    }

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(m == goal or (m not in seen and reaches(m, goal, seen | {m})) for m in graph.get(start, ()))

    assert [m for m in graph if reaches(m, m, set())] == []


def test_the_runners_checks_load_no_torch():
    # the runners' `python -m runner.preflight` answers in a fraction of a second because it never loads torch
    modules = closure(source("runner.preflight"), ("common.", "runner.")) | {"runner.preflight"}
    assert {"common.config", "common.cli", "common.runs"} <= modules
    for module in modules:
        heavy = {m for m in imports(source(module), module_level=True) if m.split(".")[0] in ("torch", "torchvision")}
        assert not heavy, f"{module} imports {heavy} when it is loaded"
