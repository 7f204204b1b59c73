"""Copying a strategy: the loops docs/copying.md shows (loops/ddp.py, loops/fsdp.py, loops/tp.py, loops/pipeline.py,
loops/cp.py), run as they are. Each trains on 4 gloo processes (TP also as FSDP x TP, 2 x 2; the pipeline in 4 stages;
CP as a ring of 4), accumulating gradients over 2 chunks (the pipeline over 4 micro-batches), and follows the same
loop's one-process run without accumulation step by step, in the loss and the clipped-by gradient norm; the first four
one-process runs are one run (the same model, data and seed; CP's loop has a sequence model of its own, and its ring's
sends are counted). The scripts' own wraps (`apply_ddp`, `apply_fsdp`, `apply_tp`, `apply_pipeline`), put in place of
a loop's, train its model (which this suite does not define) alike, and the loops' own `torchrun` line runs.

Starting torch costs ~3 s a process, so the runs share one start: this module, run as `python -m
tests.integration.test_copying OUT`, imports torch and the loops once and forks each run's processes from itself, one
run after the other, each process with the environment torchrun gives its workers (none for a one-process run, as
`python loops/ddp.py` has)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import socket
import sys
import traceback
from pathlib import Path

import pytest

from tests.helpers import ROOT, max_abs_diff
from tests.integration.early import Command

STEPS = 10
# {run: (loop, its flags, processes, the script's wrap put in place of the loop's)}; a one-process run accumulates
# nothing (--accum 1), so that a loop's accumulation shows against it
RUNS: dict[str, tuple[str, list[str], int, str | None]] = {
    **{f"{loop} 1": (loop, ["--accum", "1"], 1, None) for loop in ("ddp", "fsdp", "tp", "pipeline", "cp")},
    "ddp": ("ddp", ["--accum", "2"], 4, None),
    "fsdp": ("fsdp", ["--accum", "2"], 4, None),
    "tp": ("tp", ["--accum", "2"], 4, None),
    "fsdp x tp": ("tp", ["--dp", "2", "--accum", "2"], 4, None),
    "pipeline": ("pipeline", ["--accum", "4"], 4, None),
    "cp": ("cp", ["--accum", "2"], 4, None),
    "ddp, apply_ddp": ("ddp", ["--accum", "2"], 4, "train_ddp.apply_ddp"),
    "hsdp, apply_fsdp": ("fsdp", ["--dp", "2", "--accum", "2"], 4, "train_fsdp.apply_fsdp"),
    "fsdp x tp, apply_tp": ("tp", ["--dp", "2", "--accum", "2"], 4, "train_tp.apply_tp"),
    "pipeline, apply_pipeline": ("pipeline", ["--accum", "4"], 4, "train_pippy.apply_pipeline"),
}
# bad input, each refused before a process group exists: {run: (loop, flags, the line rank 0 prints)}
BAD = {
    "ddp --accum 3": ("ddp", ["--accum", "3"], "error: --batch-size 64 --accum 3: 4 ranks x 3 chunks do not split"),
    "fsdp --dp 3": ("fsdp", ["--dp", "3"], "error: --dp 3: 4 ranks do not make 3 equal replicas; use a divisor of 4"),
    "tp --dp 3": ("tp", ["--dp", "3"], "error: --dp 3: 4 ranks make no 3 replicas of 1, 2, 4 or 8 TP ranks"),
    "pipeline --accum 2": (
        "pipeline",
        ["--accum", "2"],
        "error: --batch-size 64 --accum 2: 1F1B needs 4 micro-batches",
    ),
    "cp --seq-len 60": ("cp", ["--seq-len", "60"], "error: --seq-len 60: 4 ranks need 8 equal chunks"),
}
LINE = re.compile(r"step (\d+) loss (\S+) grad_norm (\S+) accumulated (\d+)")
MAX_GRAD_NORM = 1.0  # the loops' own

STARTED = {
    "runs": Command([sys.executable, "-m", "tests.integration.test_copying", "{out}"], timeout_s=480),
    # the loops' own command line, once: HSDP, 2 replicas of 2 shards
    "torchrun": Command(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "loops/fsdp.py"]
        + ["--dp", "2", "--accum", "2", "--steps", str(STEPS)],
        timeout_s=240,
    ),
}


def load_loop(loop: str) -> object:
    """loops/<loop>.py as a module, its `main` not run."""
    spec = importlib.util.spec_from_file_location(f"loops_{loop}", ROOT / "loops" / f"{loop}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def count_calls(module: object, name: str) -> list[None]:
    """Wraps `module.name` (in this forked process alone) so that each call appends to the list returned."""
    calls, original = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(None)
        return original(*args, **kwargs)

    setattr(module, name, counted)
    return calls


def launch(out: Path, run: str, loop: object, flags: list[str], nproc: int, wrap: str | None) -> list[int]:
    """`loop.main(flags)` in `nproc` processes forked from this one, with torchrun's environment for a worker (none
    for one process); each rank's stdout and stderr in out/<run>.<rank>.{stdout,stderr}, and how many times it called
    `batch_isend_irecv` in out/<run>.<rank>.sends. The exit codes, by rank."""
    with socket.socket() as s:  # a free port for rank 0's store, as torchrun --standalone finds one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pids = []
    for rank in range(nproc):
        if (pid := os.fork()) == 0:
            code = 1
            with open(out / f"{run}.{rank}.stdout", "w") as stdout, open(out / f"{run}.{rank}.stderr", "w") as stderr:
                try:
                    if nproc > 1:
                        env = dict(
                            RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=nproc, LOCAL_WORLD_SIZE=nproc, MASTER_PORT=port
                        )
                        os.environ.update({k: str(v) for k, v in env.items()}, MASTER_ADDR="127.0.0.1")
                    import torch.distributed as dist  # (imported already: launch_all)

                    sends = count_calls(dist, "batch_isend_irecv")  # the ring's (and the pipeline's) exchanges
                    if wrap is not None:  # the script's function under the loop's name: the loop calls it instead
                        script, name = wrap.split(".")
                        setattr(loop, name, getattr(importlib.import_module(script), name))
                    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                        try:
                            loop.main(flags)
                            code = 0
                        except SystemExit as e:  # bad input: exit 2
                            code = e.code if isinstance(e.code, int) else 1
                    (out / f"{run}.{rank}.sends").write_text(str(len(sends)))
                except BaseException:
                    traceback.print_exc(file=stderr)
            os._exit(code)  # (no interpreter shutdown in a forked copy of the launcher)
        pids.append(pid)
    return [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]


def launch_all(out: Path) -> None:
    import torch  # noqa: F401  (started once, here, for every process forked below)

    for script in ("train_ddp", "train_fsdp", "train_tp", "train_pippy"):
        importlib.import_module(script)  # (their wraps, imported once too)
    loops = {loop: load_loop(loop) for loop in ("ddp", "fsdp", "tp", "pipeline", "cp")}
    codes = {}
    for run, (loop, flags, nproc, wrap) in RUNS.items():
        codes[run] = launch(out, run, loops[loop], [*flags, "--steps", str(STEPS)], nproc, wrap)
    for run, (loop, flags, _) in BAD.items():
        codes[run] = launch(out, run, loops[loop], flags, 4, None)
    (out / "codes.json").write_text(json.dumps(codes))


def steps_printed(text: str) -> list[tuple[int, float, float, int]]:
    """(step, loss, grad_norm, accumulated) of each line; every line must be one."""
    lines = text.splitlines()
    parsed = [LINE.fullmatch(line) for line in lines]
    assert lines and all(parsed), text
    return [(int(m[1]), float(m[2]), float(m[3]), int(m[4])) for m in parsed]


def printed(out: Path, run: str) -> list[tuple[int, float, float, int]]:
    """What the run printed: by one rank alone, the one that holds the loss (the pipeline's last stage, else 0)."""
    loop, _, nproc, _ = RUNS[run]
    logger = nproc - 1 if loop == "pipeline" else 0
    for rank in range(nproc):
        text = (out / f"{run}.{rank}.stdout").read_text()
        assert bool(text) == (rank == logger), (run, rank, text)
    return steps_printed((out / f"{run}.{logger}.stdout").read_text())


def follows(run: list[tuple], reference: list[tuple], accumulated: int) -> None:
    """Every step once, in order, each accumulated over `accumulated` chunks, and within 1e-5 of the reference in the
    loss and the gradient norm (the strategies' rounding measured ~1e-7 apart)."""
    assert [r[0] for r in run] == list(range(1, STEPS + 1)), run
    assert {r[3] for r in run} == {accumulated}, run
    assert max_abs_diff([r[1] for r in run], [r[1] for r in reference]) <= 1e-5, (run, reference)
    assert max_abs_diff([r[2] for r in run], [r[2] for r in reference]) <= 1e-5, (run, reference)


def accumulation(run: str) -> int:
    flags = RUNS[run][1]
    return int(flags[flags.index("--accum") + 1])


def finished(early) -> Path:
    out, _ = early.finished("copying/runs")
    codes = json.loads((out / "codes.json").read_text())
    failed = {run: c for run, c in codes.items() if run in RUNS and c != [0] * RUNS[run][2]}
    stderr = {f.name: f.read_text()[-2000:] for f in out.glob("*.stderr") if f.read_text()}
    assert not failed, (failed, stderr)
    return out


def test_the_four_loops_on_one_process_are_one_run_that_learns_and_clips(early):
    out = finished(early)
    reference = printed(out, "ddp 1")
    assert reference[-1][1] < 0.8 * reference[0][1]  # it learns, far beyond the tolerance: the checks can fail
    clipped = [r for r in reference if r[2] > MAX_GRAD_NORM]
    assert 2 <= len(clipped) < STEPS, reference  # the clipping acts on some steps, not all: a wrong norm shows
    for loop in ("fsdp", "tp", "pipeline"):
        follows(printed(out, f"{loop} 1"), reference, accumulated=1)  # the same model, data and seed in each


def test_the_cp_loop_learns_and_its_ring_of_4_sends_as_ring_attention_does(early):
    """One process: a ring of one, no sends. 4 processes: per attention layer and chunk, forward (cp - 1) exchanges of
    the keys and values, backward (cp - 1) of them and cp of their gradients (the last brings them home)."""
    out = finished(early)
    reference = printed(out, "cp 1")
    assert reference[-1][1] < 0.95 * reference[0][1], reference  # it learns, far beyond the tolerance
    sends = {run: [int((out / f"{run}.{rank}.sends").read_text()) for rank in range(RUNS[run][2])] for run in RUNS}
    assert sends["cp 1"] == [0], sends
    cp, blocks = 4, load_loop("cp").N_BLOCKS
    expected = STEPS * accumulation("cp") * blocks * ((cp - 1) + (cp - 1) + cp)
    assert sends["cp"] == [expected] * cp, (sends["cp"], expected)


@pytest.mark.parametrize("run", [run for run, (_, _, nproc, wrap) in RUNS.items() if nproc > 1 and wrap is None])
def test_each_loop_on_4_processes_follows_its_one_process_run(early, run):
    out = finished(early)
    follows(printed(out, run), printed(out, f"{RUNS[run][0]} 1"), accumulated=accumulation(run))


@pytest.mark.parametrize("run", [run for run, (_, _, _, wrap) in RUNS.items() if wrap is not None])
def test_the_scripts_wrap_in_a_loop_trains_the_loops_model_alike(early, run):
    out = finished(early)
    follows(printed(out, run), printed(out, f"{RUNS[run][0]} 1"), accumulated=accumulation(run))


def test_the_loops_torchrun_line_runs(early):
    _, stdout = early.finished("copying/torchrun")
    reference = printed(finished(early), "fsdp 1")
    follows(steps_printed(stdout), reference, accumulated=2)  # (rank 0's lines alone: the others print none)


def test_bad_input_is_one_line_and_exit_2_before_any_process_group(early):
    out = finished(early)
    codes = json.loads((out / "codes.json").read_text())
    for run, (_, _, line) in BAD.items():
        assert codes[run] == [2, 2, 2, 2], (run, codes[run])
        said = [(out / f"{run}.{rank}.stderr").read_text() for rank in range(4)]
        assert said[0].startswith(line) and said[0].count("\n") == 1 and not any(said[1:]), (run, said)


def test_every_line_docs_copying_md_quotes_is_in_its_loop():
    """Each python block of docs/copying.md opens with `# loops/<file>.py` (EP, which has no loop: `# train_ep.py`)
    and quotes lines of that file (indentation aside): the page shows the code these tests (test_ep.py) run."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "copying.md").read_text(), re.S)
    assert len(blocks) == 6, blocks
    for block in blocks:
        first, *lines = block.splitlines()
        assert first.startswith("# loops/") or first == "# train_ep.py", first
        source = {line.strip() for line in (ROOT / first.removeprefix("# ")).read_text().splitlines()}
        assert lines and not [line for line in lines if line.strip() not in source], (first, lines)


if __name__ == "__main__":
    launch_all(Path(sys.argv[1]))
