"""Launch the real scripts as the user would, and read what they wrote. Every launch has a timeout, so a
hung collective fails the test instead of hanging the suite."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import pytest

from common.versions import Need, older_than

ROOT = Path(__file__).resolve().parent.parent
LAUNCH_TIMEOUT_S = 240

# The 1-process references' thread: each rank's on a 2-core machine (tests/integration/conftest.py says why)
ONE_THREAD = ["--threads", "1"]
# Small and fast, but the real thing: the built-in data set, cut down. 64 test images: the evaluation through each
# strategy's forward is checked by its count of hits (every image counted once, the same predictions as one process),
# which 64 shows as well as 256 did; at 256, evaluating took ~12 % of the 2-process launch's CPU time (py-spy).
TEST_SIZE = 64
QUIET_TEST = ["--test-size", str(TEST_SIZE), "--log-every", "1000"]
SMALL = ["--train-size", "1536", *QUIET_TEST]
# Step-by-step comparable runs: no dropout (its masks depend on the rank), fp32, and a learning rate at
# which the 1-process run is itself stable. AdamW divides each gradient element by its own running RMS, so
# elements whose gradient is mostly rounding noise (LayerNorm's per-position bias at rarely active
# positions) turn ~1e-7 summation-order differences into visible weight differences, which then grow from
# step to step: at --lr 2e-3 even 1- and 2-thread single-process runs drift apart (past 1e-4 by step 50,
# ~6e-3 within 100 steps); at 1e-4, over 30 steps, 1, 2, 3 and 4 ranks agree to ~1e-6 (measured here).
STABLE = ["--dropout", "0", "--warmup-steps", "4", "--lr", "1e-4"]
PARITY_STEPS = 30
# A global batch of 48 over 768 samples, 16 steps an epoch as 96 over 1,536 were (each world size divides it): the
# 30 steps of one process on one thread took 1.5 s instead of 4.2, a step of 4 processes on 2 cores 0.10 s instead
# of 0.13 (there the processes' own overhead stays); the parity measured the same, ~2e-7 in the loss
PARITY_TRAIN_SIZE = 768
PARITY = ["--train-size", str(PARITY_TRAIN_SIZE), *QUIET_TEST, *STABLE, "--max-steps", str(PARITY_STEPS)]
PARITY += ["--batch-size", "48"]
# what the ~20 pipeline trainings can afford: 20 steps of a global batch of 48 over the 1,536 samples
PP_PARITY = [*SMALL, *STABLE, "--max-steps", "20", "--batch-size", "48"]
# 40 steps at --lr 2e-3, where AdamW turns a 1-ulp gradient difference into ~1e-3 of loss within ~20 steps: only an
# exact resume repeats such a run (test_resume.py, test_interruptions.py: the same trainings, trained once)
EXACT = [*SMALL, "--max-steps", "40", "--batch-size", "64", "--dropout", "0", "--lr", "2e-3"]
EXACT += ["--checkpoint-every", "10"]
# AdamW clipped by the global gradient norm, the clipping active on most steps (at this batch and learning rate the
# whole gradient's norm stays above 0.5): test_essentials.py's runs of every FSDP mode against one process, which
# test_fsdp.py's AdamW parity of the sharding modes reads too (the same trainings, trained once)
CLIP_STEPS = 20
CLIP = [*SMALL, "--max-grad-norm", "0.5", "--dropout", "0", "--lr", "1e-4", "--batch-size", "64"]
CLIP += ["--max-steps", str(CLIP_STEPS), "--warmup-steps", "4"]
# SGD (momentum 0.9) at a learning rate where the 1-process run is itself stable across thread counts:
# at 0.02 the loss spikes and 4-rank runs drift 2e-4 from it within 24 steps; at 0.005, over 30 steps, 1- vs
# 2-thread runs agree to ~2e-6 and 4 ranks to ~3e-5 (measured here).
SGD = ["--optimizer", "sgd", "--lr", "0.005"]
# SGD's parity against one process (|Δloss|, relative |Δgrad_norm|), DDP's and FSDP's. On an AVX2 CPU (2026-11-27, AMD
# EPYC Zen 3) every 4-rank run drifted 1e-6 apart by step 15, then at step 16 a ReLU or pooling unit fell on the other
# side of its kink in one run and not the other: 4e-4 in grad_norm at once, and the losses up to 9e-4 and grad_norm
# 3e-3 apart by step 30, where they stayed. So steps 1-15 are checked tightly, ~10x the 4.8e-7 and 3.4e-6 measured
# over them (1 against 2 threads, 4 ranks against one process; over all 30 steps 6.6e-6 and 2.9e-5, no kink; 2-core
# AMD EPYC Zen 4, torch 2.14.1, 2026-12-03), and steps 16 on with ~3x Zen 3's: a bug in the averaging (a sum over 4
# ranks, a rank's gradient missing) is 10 to 100x more.
SGD_FOLLOWS = {"loss": 4e-6, "grad_norm": 3e-5, "kink_from": 16, "kinked": {"loss": 3e-3, "grad_norm": 1e-2}}
# AdamW's DDP and FSDP runs against one process, 30 steps: on an AMD EPYC Zen 5 (2026-11-29) every 3- and 4-rank run's
# grad_norm stood 1.9e-4 from the reference's at step 29 (~1e-5 before it) while the losses stayed 3e-7 apart: computed
# in float64 from each run's step-28 weights, the two norms are 1.9e-4 apart too, so the gradient itself jumped (a
# ReLU's or the max pool's input on the other side of its kink), not its arithmetic (docs/comparing.md). From step 29
# on, 10x that in grad_norm (a gradient off by a factor, or missing a rank's share, is >= 1e-2 off) and 1e-5 in the
# loss (3.6e-6 at step 30 there); each module checks the steps before it with its own measured tolerance (no kink on
# a Zen 4, 2026-12-03: 2.2e-6 at most in grad_norm at step 29).
KINK = {"kink_from": 29, "kinked": {"loss": 1e-5, "grad_norm": 2e-3}}


def needs_torch(need: Need) -> pytest.MarkDecorator:
    """Skip, saying why, where the installed torch is older than `need` (common/versions.py): the suite's own
    refusal is what such a torch gets, and tests/floor checks it."""
    (major, minor), what, _ = need
    return pytest.mark.skipif(older_than(need), reason=f"{what} needs torch >= {major}.{minor} (docs/versions.md)")


def env_for_tests() -> dict[str, str]:
    env = dict(os.environ, PYTHON=sys.executable, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    # A 1-process run computes on a thread per core, beside the other tests' processes: OpenMP's threads wait for
    # each other asleep, not spinning on a core another process needs (the same arithmetic; tests/README.md)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # The tests assert CPU arithmetic (gloo, bit-for-bit resumes, 1e-6 parity): on a GPU machine the launched runs
    # hide the GPU rather than mix a CUDA 1-process run with CPU ranks. bench/gpu_proof.sh runs the CUDA paths.
    env["CUDA_VISIBLE_DEVICES"] = ""
    # oneDNN below AVX512-FP16 (no effect on a CPU without it): there it computes an fp16 convolution's weight
    # gradient in its reference code, 16x slower than torch's, and test_fp16.py checks loss scaling, not oneDNN's
    # kernels (docs/precision.md). ONEDNN_MAX_CPU_ISA=ALL pytest runs them as they are.
    env.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    env.pop("RANK", None)
    return env


def run_command(
    cmd: list[str], *, timeout: float = LAUNCH_TIMEOUT_S, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env=env or env_for_tests(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise command_failed(cmd, f"exited {proc.returncode}", proc.stdout, proc.stderr)
    return proc


class CommandFailed(AssertionError):
    """A command a test needed to succeed did not: a crash, not an assertion on what a feature did
    (tests/mutations.py does not count it as a catch)."""


def command_failed(cmd: list[str], how: str, stdout: str, stderr: str) -> CommandFailed:
    """A command that failed, `how` ("exited 1"), with the ends of what it printed."""
    return CommandFailed(f"{' '.join(cmd)} {how}\n--- stdout\n{stdout[-3000:]}\n--- stderr\n{stderr[-5000:]}")


def launch(script: str, nproc: int, args: list[str], out: Path, **kw) -> subprocess.CompletedProcess:
    """`python script` for nproc == 1, else torchrun --standalone with nproc processes."""
    if nproc == 1:
        cmd = [sys.executable, script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), script]
    return run_command([*cmd, *args, "--out", str(out)], **kw)


def free_port() -> int:
    """A port nothing listens on now, for a rendezvous at MASTER_PORT (--standalone picks its own)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_metrics(out: Path) -> tuple[dict[int, dict], list[dict]]:
    """({step: train record}, [eval records]) from out/metrics.jsonl; fails on a step logged twice."""
    train, evals = {}, []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "train":
            assert record["step"] not in train, f"step {record['step']} logged twice in {out}"
            train[record["step"]] = record
        else:
            evals.append(record)
    return train, evals


def losses(out: Path) -> list[float]:
    train, _ = read_metrics(out)
    assert sorted(train) == list(range(1, len(train) + 1)), f"missing steps in {out}: {sorted(train)}"
    return [train[s]["loss"] for s in sorted(train)]


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), f"{len(a)} vs {len(b)} steps"
    return max(abs(x - y) for x, y in zip(a, b))


def grad_norms(out: Path) -> list[float]:
    train, _ = read_metrics(out)
    return [train[s]["grad_norm"] for s in sorted(train)]


def assert_follows(
    out: Path,
    ref: Path,
    *,
    loss: float,
    grad_norm: float | None = None,
    steps: range | None = None,
    kink_from: int | None = None,
    kinked: dict[str, float] | None = None,
) -> None:
    """The run in `out` follows the reference run `ref` step by step (`steps`: those compared, all by default):
    |Δloss| <= `loss` and, with `grad_norm`, |Δgrad_norm| / grad_norm <= `grad_norm` at each of them; with
    `kink_from`, the steps from that one on are held to `kinked`'s tolerances instead (where a ReLU's or the max pool's
    input may fall on the other side of its kink in one run only: KINK, SGD_FOLLOWS). The gradient norm sees what
    AdamW's loss hides (a gradient off by a constant factor moves AdamW's step little). The reference's loss must move
    by far more than the tolerances over its run, or the check could not fail. With PARITY_REPORT set to a file, each
    comparison's measured differences are appended to it, before the kink ("measured") and from it on ("kinked"): how
    the tolerances were chosen."""
    run_losses, ref_losses = losses(out), losses(ref)
    steps = steps or range(1, len(run_losses) + 1)
    assert len(run_losses) >= steps[-1] and len(ref_losses) >= steps[-1], (len(run_losses), len(ref_losses))
    tight = {"loss": loss, "grad_norm": grad_norm}
    groups = {  # {name: (the steps it holds, their tolerances)}
        "measured": ([s for s in steps if kink_from is None or s < kink_from], tight),
        "kinked": ([s for s in steps if kink_from is not None and s >= kink_from], {**tight, **(kinked or {})}),
    }
    groups = {name: group for name, group in groups.items() if group[0]}
    most = max(tolerances["loss"] for _, tolerances in groups.values())
    assert max(ref_losses) - min(ref_losses) > 100 * most, f"{ref}: the reference barely moves"
    run_norms, ref_norms = grad_norms(out), grad_norms(ref)
    found = {}  # {name: {kind: (the largest difference, its step)}}
    for name, (picked, tolerances) in groups.items():
        found[name] = {"loss": max((abs(run_losses[s - 1] - ref_losses[s - 1]), s) for s in picked)}
        if tolerances["grad_norm"] is not None:
            norms = ((abs(run_norms[s - 1] - ref_norms[s - 1]) / ref_norms[s - 1], s) for s in picked)
            found[name]["grad_norm"] = max(norms)
    if report := os.environ.get("PARITY_REPORT"):
        with open(report, "a") as f:
            test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
            measured = {name: {kind: diff for kind, (diff, _) in kinds.items()} for name, kinds in found.items()}
            f.write(json.dumps({"test": test, "out": out.name, "ref": ref.name, "kink_from": kink_from, **measured}))
            f.write("\n")
    for name, kinds in found.items():
        for kind, (diff, step) in kinds.items():
            what = "|Δloss|" if kind == "loss" else "relative |Δgrad_norm|"
            allowed = groups[name][1][kind]
            assert diff <= allowed, f"{out.name}: {what} {diff:.2e} > {allowed:.0e} at step {step} against {ref.name}"


def read_run(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())


def printed(out: Path) -> str:
    """What a run of a shared launch printed, every rank's lines (tests/integration/workers/runs.py)."""
    return Path(f"{out}.log").read_text()


def observed(out: Path) -> list[dict]:
    """Each rank's probes of a run of a shared launch (tests/integration/workers/observe.py: every training writes
    them, the layers' only with `Run(..., observe=True)`), in rank order. A missing or empty folder, or a rank
    missing, fails here: a loop over the ranks would otherwise check nothing and pass."""
    folder = Path(f"{out}.observed")
    files = sorted(folder.glob("rank*.json"), key=lambda f: int(f.stem[len("rank") :]))
    assert files, f"no probes in {folder}: {'it is empty' if folder.is_dir() else 'no such folder'}"
    ranks = [int(f.stem[len("rank") :]) for f in files]
    assert ranks == list(range(len(files))), f"{folder} holds the probes of ranks {ranks}, not 0..{len(files) - 1}"
    return [json.loads(f.read_text()) for f in files]


def assert_resumed(out: Path, step: int, output: str, *, source: Path | None = None) -> None:
    """The run in `out` resumed from its checkpoint of step `step` instead of starting over: `output` (what it
    printed) has the resume's line, no previous run was set aside to `<out>.1`, and, with `source` (the run whose
    folder it continued), the records of steps 1..step are that run's, unchanged, timing fields included."""
    line = f"resumed from {out}/checkpoints/step_{step:07d} (step {step})"
    assert line in output, f"no {line!r} in:\n{output[-3000:]}"
    assert not Path(f"{out}.1").exists(), f"{out} was set aside as a new run, not resumed"
    if source is not None:
        (train, evals), (before, before_evals) = read_metrics(out), read_metrics(source)
        assert [train[s] for s in range(1, step + 1)] == [before[s] for s in range(1, step + 1)]
        assert [e for e in evals if e["step"] <= step] == [e for e in before_evals if e["step"] <= step]
        assert sorted(train)[-1] > step, "nothing trained after the resume"


def rewind(src: Path, dst: Path, step: int) -> Path:
    """A copy of run folder `src` as a run stopped right after step `step` would have left it: the
    checkpoints up to that step and the metrics records up to it."""
    (dst / "checkpoints").mkdir(parents=True)
    for checkpoint in (src / "checkpoints").glob("step_???????"):
        if int(checkpoint.name[len("step_") :]) <= step:
            shutil.copytree(checkpoint, dst / "checkpoints" / checkpoint.name)
    lines = (src / "metrics.jsonl").read_text().splitlines(keepends=True)
    (dst / "metrics.jsonl").write_text("".join(line for line in lines if json.loads(line)["step"] <= step))
    return dst


@dataclass(frozen=True)
class Run:
    """One training for a shared launch (tests/integration/conftest.py): train_<strategy>.py's training with
    `flags` on `nproc` processes. With `rewound_from` (another run's name in the pool, a step) it starts in a
    copy of that run as it stood after that step (rewind), e.g. to --resume it. With `observe`, probes record what
    its layers computed (`observed`). Strategies "skip-agreement" and "ring" are not trainings but checks on real
    ranks (tests/integration/workers/runs.py). A `heavy` run (a further point of a sweep whose first point every
    `pytest` checks) is trained only where its module's heavy tests run (`pytest -m heavy`; `tiered` marks them)."""

    strategy: str
    flags: list[str] = field(default_factory=list)
    nproc: int = 4
    rewound_from: tuple[str, int] | None = None
    observe: bool = False
    heavy: bool = field(default=False, repr=False)  # (not in repr: a training asked for alike is trained once)


def tiered(names: Iterable[str], runs: dict[str, Run]) -> list:
    """Parameters for a test over shared runs: a heavy run's marked heavy, so that `pytest` leaves its test out."""
    return [pytest.param(name, marks=pytest.mark.heavy) if runs[name].heavy else name for name in names]


def start_many(runs: dict[str, Run], nproc: int, root: Path) -> subprocess.Popen:
    """Several trainings {name: run}, all on nproc processes, one after another in ONE launch (torchrun; plain
    python for one), started in a process group of its own (start_process) and returned; each writes to root /
    name, and a `rewound_from` name is read from root too. tests/integration/workers/runs.py runs the real
    train_<strategy>.train for each."""
    spec = {
        str(root / name): {
            "strategy": run.strategy,
            "flags": run.flags,
            "rewind": run.rewound_from and [str(root / run.rewound_from[0]), run.rewound_from[1]],
            "observe": run.observe,
        }
        for name, run in runs.items()
    }
    path = Path(tempfile.mkstemp(suffix=".json", prefix="runs-", dir=root)[1])
    path.write_text(json.dumps(spec))
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc > 1 else []
    return start_process([sys.executable, *launcher, "tests/integration/workers/runs.py", str(path)], new_session=True)


# ------------------------------------------------------------------------------------ killing a worker
def processes() -> Iterator[tuple[int, list[str]]]:
    """(pid, argv) of every process on this machine that is still there when read."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                yield int(pid), f.read().decode(errors="replace").split("\0")
        except OSError:
            continue  # exited meanwhile


def workers_writing_to(out: Path) -> dict[int, int]:
    """{pid: rank} of the training workers (not the torchrun agent) whose --out is `out`."""
    workers = {}
    for pid, argv in processes():
        if str(out) not in argv or "torch.distributed.run" in argv or not any(a.startswith("train_") for a in argv):
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = dict(v.split("=", 1) for v in f.read().decode(errors="replace").split("\0") if "=" in v)
            workers[pid] = int(environ.get("RANK", 0))
        except (OSError, ValueError):
            continue  # exited meanwhile
    return workers


def last_logged_step(out: Path) -> int:
    try:
        return max(read_metrics(out)[0], default=0)
    except (OSError, ValueError, AssertionError):  # not there yet, a line half-written, or rewritten by a resume
        return 0


def start_runner(
    strategy: str,
    flags: list[str],
    out: Path,
    *,
    new_session: bool = False,
    preexec_fn: Callable[[], None] | None = None,
    **env: str,
) -> subprocess.Popen:
    """bash run_<strategy>.sh, its output in one pipe; with `new_session`, in a process group of its own, as a
    terminal starts it (to press Ctrl-C); `preexec_fn` runs in it before bash (a resource limit, say)."""
    cmd = ["bash", f"run_{strategy}.sh", *flags, "--out", str(out)]
    return start_process(cmd, new_session=new_session, preexec_fn=preexec_fn, **env)


def start_process(
    cmd: list[str], *, new_session: bool = False, preexec_fn: Callable[[], None] | None = None, **env: str
) -> subprocess.Popen:
    """`cmd` started in the checkout with the tests' environment (and `env`), its output in one pipe; with
    `new_session`, in a process group of its own (to be signalled or killed whole)."""
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**env_for_tests(), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=new_session,
        preexec_fn=preexec_fn,
    )


def kill_a_worker_when(
    runner: subprocess.Popen,
    out: Path,
    nproc: int,
    ready: Callable[[], bool],
    *,
    poll_s: float = 0.02,
    timeout_s: float = LAUNCH_TIMEOUT_S,
) -> tuple[int, str]:
    """SIGKILL the highest-ranked of the `nproc` training workers of `runner` as soon as `ready()` holds,
    asked every `poll_s` (the poll takes CPU from the workers on a small machine: poll fast only to hit a
    short window); then wait for the runner to end. Returns (the killed rank, everything the runner printed)."""
    deadline = time.monotonic() + timeout_s
    try:
        workers: dict[int, int] = {}
        while runner.poll() is None and time.monotonic() < deadline:
            if len(workers) < nproc:
                workers = workers_writing_to(out)  # a scan of /proc: the workers take seconds to start anyway
                time.sleep(0.05)
            elif ready():
                break
            else:
                time.sleep(poll_s)
        else:
            raise AssertionError(
                f"the run ended or timed out before it could be killed:\n{runner.communicate()[0][-3000:]}"
            )
        victim, rank = max(workers.items(), key=lambda item: item[1])
        os.kill(victim, signal.SIGKILL)
        return rank, runner.communicate(timeout=timeout_s)[0]
    finally:
        runner.kill()


def markdown_rows(stdout: str) -> dict[str, dict[str, str]]:
    """The Markdown table as {run: {column: cell}}; a cell's "|" is escaped as "\\|", as Markdown wants."""

    def cells(line: str) -> list[str]:
        return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]

    lines = [line for line in stdout.splitlines() if line.startswith("|")]
    header = cells(lines[0])
    assert all(len(cells(line)) == len(header) for line in lines), lines
    return {row["run"]: row for row in (dict(zip(header, cells(line))) for line in lines[2:])}
