"""What happens to a run, through the runners as a user starts them: Ctrl-C, preemption (SIGTERM to the runner or
to torchrun), a checkpoint that cannot be written, memory run out (a worker killed by SIGKILL, which is how the
kernel's out-of-memory killer ends one, is test_fsdp.py's killed-during-a-save run). Each one ends in at
most 3 lines besides the training's own, with its exit code, files intact, and a --resume that continues with
every step once, on the uninterrupted run's curve bit for bit (same world size, same arithmetic)."""

from __future__ import annotations

import os
import re
import resource
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import (
    EXACT,
    LAUNCH_TIMEOUT_S,
    ONE_THREAD,
    ROOT,
    SMALL,
    Run,
    assert_resumed,
    env_for_tests,
    last_logged_step,
    losses,
    processes,
    read_metrics,
    rewind,
    run_command,
    start_process,
    start_runner,
    workers_writing_to,
)

STRATEGIES = ("ddp", "fsdp", "pippy", "tp")
# the uninterrupted runs (test_resume.py's too): 40 steps at --lr 2e-3, a checkpoint every 10 (helpers.EXACT), on 2
# processes; and DDP's on one process, one thread (its story restarts the runner 4 times: a worker's start is ~4
# CPU-s here)
ONE = [*EXACT, *ONE_THREAD]
POOLED = {**{s: Run(s, EXACT, nproc=2) for s in STRATEGIES}, "ddp1": Run("ddp", ONE, nproc=1)}
# what a run prints when nothing goes wrong: everything else counts against the 3 lines an interruption may add
TRAINING = re.compile(
    r"^(DDP|FSDP|pipeline|TP) \||^\w[\w-]*: \d+ train|^Baby(CNN|ViT)|^  stage \d|^resum|^(step|eval) +\d+/"
)


@pytest.fixture(scope="module")
def uninterrupted(pool):
    return pool / "interruptions"


def start(
    strategy: str, flags: list[str], out: Path, *, limit: tuple[int, int] | None = None, nproc: int = 2
) -> subprocess.Popen:
    """The runner on `nproc` processes, in a process group of its own, as a terminal starts it (so the test can press
    Ctrl-C); with `limit` (resource, bytes) under that limit, which its children inherit."""

    def set_limit() -> None:
        if limit:
            resource.setrlimit(limit[0], (limit[1], limit[1]))

    return start_runner(strategy, flags, out, new_session=True, preexec_fn=set_limit, NPROC=str(nproc))


def when_past(runner: subprocess.Popen, out: Path, step: int, act) -> tuple[int, str]:
    """Call `act()` as soon as step `step` is logged; returns the runner's exit code and what it printed."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    try:
        while last_logged_step(out) < step:
            assert runner.poll() is None and time.monotonic() < deadline, runner.communicate()[0][-3000:]
            time.sleep(0.02)
        act()
        printed = runner.communicate(timeout=LAUNCH_TIMEOUT_S)[0]
        return runner.returncode, printed
    finally:
        runner.kill()


def extra_lines(printed: str) -> list[str]:
    return [line for line in printed.splitlines() if line.strip() and not TRAINING.match(line)]


def continue_command(printed: str) -> str:
    found = re.search(r"continue with: (.+)$", printed, re.M)
    assert found, printed[-3000:]
    return found.group(1)


def run_shell(command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", command], cwd=ROOT, env=env_for_tests(), capture_output=True, text=True, timeout=600
    )


def assert_continues_exactly(out: Path, reference: Path, stopped_at: int, output: str, before: dict) -> None:
    """The run that stopped with a checkpoint of step `stopped_at` went on from it (its `output` says so, and the
    records up to it, `before`, are kept as they were), and ended on the uninterrupted curve, bit for bit."""
    assert_resumed(out, stopped_at, output)
    train, _ = read_metrics(out)  # (fails on a step logged twice)
    assert [train[s] for s in range(1, stopped_at + 1)] == [before[s] for s in range(1, stopped_at + 1)]
    assert sorted(train) == list(range(1, 41))
    assert losses(out) == losses(reference)  # max |dloss| = 0


def test_ctrl_c_then_two_preemptions_then_the_run_ends_on_the_uninterrupted_curve(uninterrupted, tmp_path):
    """DDP on one process (that several stop together is SIGUSR1's and the pipeline's story): Ctrl-C (SIGINT to the
    runner's process group, as a terminal sends it) once step 13 is logged; the printed command continues; SIGTERM
    to torchrun alone once step 17 is; continued with --preempt-signal USR2; SIGUSR2 to the runner once step 25 is;
    continued to the end. Every stop is one or two lines, no traceback; every continuation resumes from the
    checkpoint the stop left; the curve is the uninterrupted one."""
    out = tmp_path / "run"
    runner = start("ddp", ONE, out, nproc=1)
    code, printed = when_past(runner, out, 13, lambda: os.killpg(runner.pid, signal.SIGINT))
    assert code == 130, printed[-3000:]
    assert len(extra_lines(printed)) == 1 and "Traceback" not in printed, printed[-3000:]
    interrupted = re.search(
        r"interrupted \(SIGINT\) at step (\d+) \(the latest checkpoint is (\S+) \(step (\d+)\)", printed
    )
    at, latest = int(interrupted.group(1)), int(interrupted.group(3))
    assert 13 <= at < 40 and latest == at // 10 * 10 and interrupted.group(2) == f"{out}/checkpoints/step_{latest:07d}"
    assert continue_command(printed) == f"NPROC=1 bash run_ddp.sh {shlex.join(ONE)} --out {out} --resume"
    assert not list((out / "checkpoints").glob("*.tmp"))

    # SIGTERM to torchrun alone: it passes it to its workers, which save the step they finish and stop
    before = read_metrics(out)[0]
    code, printed = when_past(
        start("ddp", [*ONE, "--resume"], out, nproc=1), out, 17, lambda: os.kill(torchrun_pid(out), signal.SIGTERM)
    )
    assert code == 143 and len(extra_lines(printed)) <= 3 and "Traceback" not in printed, printed[-3000:]
    assert_resumed(out, latest, printed)
    assert [read_metrics(out)[0][s] for s in range(1, latest + 1)] == [before[s] for s in range(1, latest + 1)]
    stopped = int(re.search(r"stopped by SIGTERM after step (\d+) of 40", printed).group(1))
    assert 17 <= stopped < 40 and (out / "checkpoints" / f"step_{stopped:07d}").is_dir(), printed[-3000:]

    # --preempt-signal USR2 (a resume may change it), and SIGUSR2 to the runner once step 25 is logged
    before, usr2 = read_metrics(out)[0], [*ONE, "--preempt-signal", "USR2", "--resume"]
    code, printed = when_past(start("ddp", usr2, out, nproc=1), out, 25, lambda: runner_signal(out, signal.SIGUSR2))
    assert code == 128 + signal.SIGUSR2 and len(extra_lines(printed)) <= 3 and "Traceback" not in printed, printed
    assert_resumed(out, stopped, printed)
    assert [read_metrics(out)[0][s] for s in range(1, stopped + 1)] == [before[s] for s in range(1, stopped + 1)]
    stopped = int(re.search(r"stopped by SIGUSR2 after step (\d+) of 40", printed).group(1))
    assert 25 <= stopped < 40 and "--preempt-signal USR2" in continue_command(printed), printed[-3000:]
    before = read_metrics(out)[0]
    finished = run_shell(continue_command(printed))
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    assert_continues_exactly(out, uninterrupted / "ddp1", stopped, finished.stdout, before)


def supervisor_pid(out: Path) -> int:
    return next(pid for pid, argv in processes() if str(out) in argv and "runner.supervise" in argv)


def torchrun_pid(out: Path) -> int:
    return next(pid for pid, argv in processes() if str(out) in argv and "torch.distributed.run" in argv[1:3])


def runner_signal(out: Path, sig: int = signal.SIGTERM) -> None:
    os.kill(supervisor_pid(out), sig)


# The pipeline's ranks hold different stages, and every one must save the same step: its story runs on every
# `pytest`. FSDP's and TP's stop the same way (the checkpoint code is every strategy's; their sharded resumes are
# test_resume.py's) and run with the heavy tier, `pytest -m heavy`.
@pytest.mark.parametrize(
    "strategy", (pytest.param("fsdp", marks=pytest.mark.heavy), "pippy", pytest.param("tp", marks=pytest.mark.heavy))
)
def test_sigterm_to_the_runner_at_step_25_saves_and_the_resumed_run_is_bit_for_bit(uninterrupted, tmp_path, strategy):
    out = tmp_path / "run"
    code, printed = when_past(start(strategy, EXACT, out), out, 25, lambda: runner_signal(out))
    assert code == 143 and len(extra_lines(printed)) <= 3 and "Traceback" not in printed, printed[-3000:]
    step = int(re.search(r"stopped by SIGTERM after step (\d+) of 40", printed).group(1))
    assert 25 <= step < 40 and (out / "checkpoints" / f"step_{step:07d}").is_dir()
    before = read_metrics(out)[0]
    finished = run_shell(continue_command(printed))
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    assert_continues_exactly(out, uninterrupted / strategy, step, finished.stdout, before)


def test_a_checkpoint_that_cannot_be_written_is_one_line_and_resume_continues(uninterrupted, tmp_path):
    """A real write error: the runner under a 1 MB file-size limit (the kernel answers EFBIG, "File too large",
    as it answers ENOSPC on a full disk), resuming after step 10; the step-20 checkpoint (6 MB on rank 0)
    cannot be written. Then, without the limit, --resume continues from step 10."""
    out = rewind(uninterrupted / "ddp", tmp_path / "run", 10)
    runner = start("ddp", [*EXACT, "--resume"], out, limit=(resource.RLIMIT_FSIZE, 1 << 20))
    printed = runner.communicate(timeout=LAUNCH_TIMEOUT_S)[0]
    assert runner.returncode == 1, printed[-3000:]
    (line,) = extra_lines(printed)
    # torch.save's writer (under DCP) reports the kernel's EFBIG as a failed write of its own
    assert re.fullmatch(
        rf"\[rank 0\] error: checkpoint {out}/checkpoints/step_0000020.tmp not written \(.*(File too large|file "
        rf"writer failed).*; \d+ MB free there\), its partial files removed; the latest checkpoint is "
        rf"{out}/checkpoints/step_0000010 \(step 10\): make room, then continue with --resume",
        line,
    ), printed[-3000:]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_0000010"]
    before = read_metrics(out)[0]
    finished = run_shell(f"NPROC=2 bash run_ddp.sh {' '.join(EXACT)} --resume --out {out}")
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    assert_continues_exactly(out, uninterrupted / "ddp", 10, finished.stdout, before)


def test_a_rank_stuck_past_timeout_s_ends_the_job_in_one_line(tmp_path):
    """A rank that stops answering (SIGSTOP: a hung process, a frozen machine) leaves the other waiting inside a
    collective; after --timeout-s it gives up and the job ends in one line naming the step, exit 1. (The stopped
    rank is let go once the other has ended, so that torchrun need not wait to kill it.)"""
    out = tmp_path / "run"
    runner = start("ddp", [*EXACT, "--timeout-s", "5", "--max-steps", "400", "--epochs", "20"], out)
    frozen = []

    def freeze_rank_1() -> None:
        frozen.extend(pid for pid, rank in workers_writing_to(out).items() if rank == 1)
        os.kill(frozen[0], signal.SIGSTOP)
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S  # rank 0 gives up after 5 s
        while 0 in workers_writing_to(out).values():
            assert time.monotonic() < deadline, "rank 0 still waits, past --timeout-s"
            time.sleep(0.2)
        os.kill(frozen[0], signal.SIGCONT)

    code, printed = when_past(runner, out, 3, freeze_rank_1)
    assert code == 1 and "Traceback" not in printed, printed[-3000:]
    (line,) = extra_lines(printed)
    assert re.fullmatch(
        r"\[rank 0\] error: a collective waited longer than --timeout-s 5 at step \d+: another rank stopped, hung or "
        r"died; raise --timeout-s if a step can take that long, then continue with --resume",
        line,
    ), line


def test_memory_run_out_in_the_cpu_allocator_is_one_line(tmp_path):
    """A real allocation failure: the medium model (155 M parameters) under a 1.5 GB data-segment limit (on one
    process: each rank's failure is its own)."""
    flags = [*SMALL, "--model-size", "medium", "--max-steps", "2"]
    runner = start("ddp", flags, tmp_path / "run", limit=(resource.RLIMIT_DATA, 1500 << 20), nproc=1)
    printed = runner.communicate(timeout=LAUNCH_TIMEOUT_S)[0]
    assert runner.returncode == 1, printed[-3000:]
    (line,) = extra_lines(printed)
    assert re.match(r"\[rank 0\] out of memory before the first step \(\d+\.\d\d GB resident at most\): ", line)
    assert "DefaultCPUAllocator: can't allocate memory" in line and "--model-size" in line


def test_cuda_out_of_memory_is_one_line_naming_the_rank_and_the_step():
    """The error CUDA's allocator raises, raised inside a script's main as `run` runs it."""
    code = (
        "import torch\n"
        "from common.distributed import Progress, run\n"
        "def main():\n"
        "    Progress.step = 7\n"
        "    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB.')\n"
        "run(main)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env_for_tests(), capture_output=True, text=True)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("[rank 0] out of memory at step 7 (") and done.stderr.count("\n") == 1
    assert "CUDA out of memory. Tried to allocate 2.00 GiB" in done.stderr


def test_metrics_that_cannot_be_written_are_one_line_and_every_line_kept_is_whole(tmp_path):
    """metrics.jsonl under a 4 KB file-size limit: it fills up after ~15 records (on one process: rank 0 writes it)."""
    out = tmp_path / "run"
    flags = [*EXACT, "--checkpoint-every", "0"]
    runner = start("ddp", flags, out, limit=(resource.RLIMIT_FSIZE, 4096), nproc=1)
    printed = runner.communicate(timeout=LAUNCH_TIMEOUT_S)[0]
    assert runner.returncode == 1, printed[-3000:]
    (line,) = extra_lines(printed)
    assert line == (
        f"[rank 0] error: {out}/metrics.jsonl not written (File too large); no checkpoint was written "
        f"(--checkpoint-every N writes one every N steps): make room, then continue with --resume"
    )
    train, _ = read_metrics(out)  # every line a whole record
    assert sorted(train) == list(range(1, len(train) + 1)) and 5 < len(train) < 40
    assert (out / "metrics.jsonl").stat().st_size <= 4096


def test_sigusr1_to_every_process_as_slurm_sends_it_saves_stops_and_resumes(uninterrupted, tmp_path):
    """SLURM's --signal=USR1@90 reaches every process of the job: the runner, torchrun (which must survive it: its
    default action would kill it) and the workers (each notes it once). The printed command continues the run from
    the step it saved, onto the uninterrupted curve."""
    out = tmp_path / "run"
    runner = start("ddp", EXACT, out)

    def signal_every_process() -> None:
        for pid, argv in processes():
            if str(out) in argv:
                os.kill(pid, signal.SIGUSR1)

    code, printed = when_past(runner, out, 5, signal_every_process)
    assert code == 128 + signal.SIGUSR1 and len(extra_lines(printed)) <= 3, printed[-3000:]
    step = int(re.search(r"stopped by SIGUSR1 after step (\d+) of 40", printed).group(1))
    assert 5 <= step < 40 and (out / "checkpoints" / f"step_{step:07d}").is_dir() and "Traceback" not in printed
    assert continue_command(printed) == f"NPROC=2 bash run_ddp.sh {shlex.join(EXACT)} --out {out} --resume"
    before = read_metrics(out)[0]
    finished = run_shell(continue_command(printed))
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    assert_continues_exactly(out, uninterrupted / "ddp", step, finished.stdout, before)


# slurm/train.sbatch on one machine: SLURM's own commands are stubs (each records its arguments in SLURM_STUB_LOG);
# srun starts its command as the one task of node 0, as it does on a 1-node job; the training is the real runner's
SLURM_STUBS = {
    "scontrol": 'echo "scontrol $*" >> "$SLURM_STUB_LOG"\n[[ $1 == show ]] && tr , "\\n" <<< "$3"\nexit 0\n',
    "srun": 'echo "srun $*" >> "$SLURM_STUB_LOG"\nwhile [[ $1 == -* ]]; do shift; done\n'
    'SLURM_NODEID=0 SLURM_PROCID=0 SLURM_LOCALID=0 exec "$@"\n',
}


def test_slurm_sbatch_requeues_a_job_stopped_by_sigusr1_and_the_requeued_job_resumes(uninterrupted, tmp_path):
    """`bash slurm/train.sbatch` as SLURM runs the batch script of a 1-node job (its variables set, scontrol and srun
    stubbed), on one process: SIGUSR1 to the job step's processes (not the batch shell: --signal without B: spares
    it) stops the training with a checkpoint (exit 138) and the script requeues the job; started again with
    SLURM_RESTART_COUNT=1, as SLURM restarts a requeued job, it passes --resume and finishes on the uninterrupted
    curve."""
    stubs, log, out = tmp_path / "bin", tmp_path / "slurm-calls.log", tmp_path / "run"
    stubs.mkdir()
    for name, body in SLURM_STUBS.items():
        (stubs / name).write_text(f"#!/bin/bash\n{body}")
        (stubs / name).chmod(0o755)
    slurm = dict(PATH=f"{stubs}:{os.environ['PATH']}", SLURM_STUB_LOG=str(log), SLURM_SUBMIT_DIR=str(ROOT), NPROC="1")
    slurm |= dict(SLURM_JOB_ID="4242", SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost", SLURM_RESTART_COUNT="0")
    sbatch = ["bash", "slurm/train.sbatch", *ONE, "--out", str(out)]
    job = start_process(sbatch, new_session=True, **slurm)

    def signal_the_job_step() -> None:
        for pid, argv in processes():
            if str(out) in argv and pid != job.pid:
                os.kill(pid, signal.SIGUSR1)

    code, printed = when_past(job, out, 5, signal_the_job_step)
    assert code == 128 + signal.SIGUSR1 and "Traceback" not in printed, printed[-3000:]
    step = int(re.search(r"stopped by SIGUSR1 after step (\d+) of 40", printed).group(1))
    assert 5 <= step < 40 and (out / "checkpoints" / f"step_{step:07d}").is_dir(), printed[-3000:]
    show, srun, *requeued = log.read_text().splitlines()
    assert show == "scontrol show hostnames localhost" and srun.endswith(f" runner {' '.join(ONE)} --out {out}"), srun
    assert requeued == ["scontrol requeue 4242"]  # the job queued again, once

    before = read_metrics(out)[0]
    log.unlink()
    again = run_command(sbatch, env={**env_for_tests(), **slurm, "SLURM_RESTART_COUNT": "1"})
    show, srun, *requeued = log.read_text().splitlines()
    assert srun.endswith(f" runner {' '.join(ONE)} --out {out} --resume"), srun
    assert requeued == []  # a finished job is not queued again
    assert_continues_exactly(out, uninterrupted / "ddp1", step, again.stdout, before)


def test_ctrl_c_on_a_script_run_without_the_runner_is_one_line(tmp_path):
    """`python train_ddp.py` (what run_all.sh does for its reference): rank 0 says where it was, exit 130."""
    out = tmp_path / "run"
    script = subprocess.Popen(
        [sys.executable, "train_ddp.py", *EXACT, "--max-steps", "400", "--epochs", "20", "--out", str(out)],
        cwd=ROOT,
        env=env_for_tests(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # as from a terminal: a suite started in the background (nohup, `&`) hands its children SIGINT ignored,
        # and Python then installs no KeyboardInterrupt handler at all
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    code, printed = when_past(script, out, 5, lambda: script.send_signal(signal.SIGINT))
    assert code == 130 and "Traceback" not in printed, printed[-3000:]
    (line,) = extra_lines(printed)
    assert re.fullmatch(r"interrupted during step \d+; --resume continues from the latest checkpoint", line)
