"""What a copy of a script carries, read from the sources: the common/ modules each training script loads (the
closure of module-level imports), that no worker-side module imports the launcher's checks, and that the
modules the launcher runs before torchrun stay free of torch."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ("train_ddp.py", "train_fsdp.py", "train_pippy.py", "train_tp.py")
LAUNCHER_ONLY = {"runner.preflight", "runner.memory", "runner.supervise"}  # the runners' side: no worker needs them
# Lines of common/ behind train_ddp.py (nanoGPT's train.py needs ~380, the FSDP2 example ~370): 1,500 when the
# library was cut down from 2,102; since then fp16's loss scaling, in every script's loop, added ~90 (the scaler,
# the unscale inside the clip, the scale in records and checkpoints, the flags and their checks) and the traffic
# each script predicts for run.json ~65 (common/traffic.py, the recorder's section), and the interruptions a user
# meets ~165 (preemption's per-step agreement, write errors that remove partial files and name the latest
# checkpoint, the one-line ends of `run`).
DDP_BUDGET = 1850


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


def common_closure(path: Path) -> set[str]:
    """The common.* modules that importing `path` loads."""
    seen: set[str] = set()
    ours = ("common.", "runner.")
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
    closure = common_closure(ROOT / "train_ddp.py")
    sizes = {m: lines({m}) for m in sorted(closure)}
    assert lines(closure) <= DDP_BUDGET, sizes
    assert {"common.recorder", "common.checkpoint", "common.data", "common.distributed"} <= closure  # it reads them


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_worker_module_imports_the_launcher(script):
    closure = common_closure(ROOT / script)
    for module in [script.removesuffix(".py"), *closure]:
        path = ROOT / script if module == script.removesuffix(".py") else source(module)
        assert not imports(path, module_level=False) & LAUNCHER_ONLY, f"{module} imports the launcher's checks"


def test_the_launcher_loads_no_torch():
    # the runners' `python -m runner.preflight` answers in a fraction of a second because it never loads torch
    closure = common_closure(source("runner.preflight")) | {"runner.preflight"}
    assert {"common.config", "common.cli", "common.runs"} <= closure
    for module in closure:
        heavy = {m for m in imports(source(module), module_level=True) if m.split(".")[0] in ("torch", "torchvision")}
        assert not heavy, f"{module} imports {heavy} when it is loaded"
