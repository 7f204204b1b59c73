"""Process-group set-up and teardown from torchrun's environment (without torchrun: a world of one, the same code
path), rank-aware logging, preemption, and how a process ends (`run`)."""

from __future__ import annotations

import os
import resource
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from common.errors import UserError, WriteError


@dataclass
class DistEnv:
    rank: int  # this process among all processes (0 .. world_size-1): use it for data and logging
    local_rank: int  # this process among the ones on its machine: use it to pick the GPU
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str  # "nccl" on CUDA, "gloo" on CPU

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed(
    *, device: str = "auto", timeout_s: int = 300, threads: int = 0, preempt_signal: str = "USR1"
) -> DistEnv:
    """Join torchrun's process group (or make a world of one) and pick this rank's device. Once joined, SIGTERM and
    `preempt_signal` ask for a checkpoint and a stop (`stop_requested`); before, SIGTERM ends the process at once."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank, local_world_size = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))

    # The device comes from LOCAL_RANK, never from RANK: on the second machine RANK is 4..7, GPUs 0..3.
    use_cuda = device == "cuda" or (
        device == "auto" and torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size
    )
    if use_cuda:
        if torch.cuda.device_count() <= local_rank:
            raise UserError(
                f"--device cuda: local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible); "
                "launch fewer processes per machine, or use --device cpu"
            )
        torch.cuda.set_device(local_rank)
        # the same seed gives the same run, and a resume the uninterrupted run: cuDNN's default convolution
        # backward adds in an order that varies from run to run (1 ulp apart by step 7 on an H100, docs/benchmarks)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        dev, backend = torch.device("cuda", local_rank), "nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
        # N processes sharing C cores must not each start C threads: oversubscribed cores run several times slower
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(threads or max(1, cores // local_world_size))

    keep_freed_memory()

    timeout, Progress.timeout_s = timedelta(seconds=timeout_s), timeout_s
    device_id = dev if use_cuda else None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent (torch 2.14.1) keeps its store when it restarts the workers: a prefix per attempt keeps
        # the new attempt from reading the failed one's keys (each rank's address) and dialing dead ports
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
        )
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"attempt_{attempt}/", store),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device_id,
        )
    elif "RANK" in os.environ:  # another launcher that sets MASTER_ADDR/PORT (env:// rendezvous)
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
    else:  # plain `python train_x.py`: a world of one, no port needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    for sig in (signal.SIGTERM, signal.Signals[f"SIG{preempt_signal}"]):
        signal.signal(sig, lambda signum, _: STOP.append(signum))  # only noted: the ranks act on it together
    return DistEnv(rank, local_rank, world_size, local_world_size, dev, backend)


def keep_freed_memory() -> bool:
    """Make glibc keep a step's freed activations mapped for the next step instead of page-faulting them in again
    (docs/performance.md measures it); False where mallopt is not available (macOS, musl): nothing changes."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h: mmap at 32 MiB (its maximum), trim at 1 GiB
    return bool(libc.mallopt(m_mmap_threshold, 32 << 20)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The part of a (possibly sharded DTensor) tensor this rank holds; in-place changes to it change the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def collective_device() -> torch.device:
    """Where a collective's tensors must live: this rank's GPU with NCCL, the CPU with gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


# gloo's words for --timeout-s run out, as a receive or the connection saw it (NCCL's watchdog aborts the process)
GLOO_TIMEOUTS = ("Timed out waiting", "Application timeout")
STOP: list[int] = []  # the preemption signals this process received (setup_distributed's handler)


class Progress:
    step = 0  # the step being trained (the recorder sets it), for the one-line errors of `run`
    timeout_s = 0  # --timeout-s, for the line of a collective that waited longer


def stop_requested() -> str | None:
    """The name of SIGTERM or --preempt-signal if any rank received it, else None. Every rank calls this after every
    step (one all-reduce): all stop after the same step, wherever the signal landed (docs/troubleshooting.md)."""
    received = torch.tensor([STOP[0] if STOP else 0], device=collective_device())
    dist.all_reduce(received, op=dist.ReduceOp.MAX)
    return signal.Signals(int(received.item())).name if received.item() else None


_LAST_MEETING: list[object] = []  # teardown_distributed's collective, kept until the process exits


def teardown_distributed() -> None:
    """Leave the process group; call it in `finally`. After a clean run the ranks first meet (an all-reduce whose
    handle is kept: gloo, torch 2.14.1, could abort a finished run in interpreter shutdown otherwise; docs/
    troubleshooting.md, "Clean exits"); after an error they don't (the others may never come)."""
    if not dist.is_initialized():
        return
    if sys.exc_info()[1] is None:  # inside `finally`: None unless an exception is on its way out
        meeting = torch.ones(1, device=collective_device())
        work = dist.all_reduce(meeting, async_op=True)
        if dist.get_backend() == "gloo":  # (NCCL's shutdown in destroy_process_group joins its threads)
            _LAST_MEETING.append(work)
        work.wait()
        meeting.item()  # waits on the host, also for NCCL, whose wait() only orders the GPU stream
    dist.destroy_process_group()


class RankLogger:
    """Prints from one rank only: the one that holds the metric (rank 0, or the last pipeline stage)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)


def run(main: Callable[[], None]) -> None:
    """Run a script's `main`, ending in one line for what a user can act on: bad input (rank 0 says it) exits 2; a
    non-finite loss, a write error, memory run out or a collective past --timeout-s exit 1, naming the rank; Ctrl-C
    130. Anything else is a bug and keeps its traceback."""
    rank = int(os.environ.get("RANK", 0))
    try:
        main()
    except UserError as e:
        if rank:  # rank 0 says it; a rank alone in its error says it itself, once rank 0 had time to end the job
            _stopped_within(seconds=3)
        print(f"[rank {rank}] error: {e}" if rank else f"error: {e}", file=sys.stderr)
        _exit(2)
    except KeyboardInterrupt:  # (under the runners, the runner's own line replaces this one)
        if rank == 0:
            when = f"during step {Progress.step}" if Progress.step else "before the first step"
            print(f"interrupted {when}; --resume continues from the latest checkpoint", file=sys.stderr)
        _exit(130)
    except SystemExit:
        raise
    except BaseException as e:  # an Exception, or DCP's CheckpointException (a BaseException)
        if STOP and _peer_gone(e):  # told to stop, and a peer stopped first: its collective's error is expected
            _exit(128 + STOP[0])
        timed_out = isinstance(e, RuntimeError) and any(m in str(e) for m in GLOO_TIMEOUTS)
        if (out_of_memory := _out_of_memory(e)) or isinstance(e, (FloatingPointError, WriteError)) or timed_out:
            if not getattr(e, "quiet", False):
                line = _memory_line(e) if out_of_memory else _timeout_line() if timed_out else f"error: {e}"
                print(f"[rank {rank}] {line}", file=sys.stderr)
            _exit(1)
        raise
    _exit(0)


def _stopped_within(*, seconds: float) -> None:  # torchrun stops the others when one rank exits: their lines go
    for _ in range(int(seconds / 0.05)):
        if STOP:
            _exit(128 + STOP[0])
        time.sleep(0.05)


def _exit(code: int) -> None:
    """Exit now, without the interpreter's shutdown, where gloo's threads can still abort a finished process."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _peer_gone(e: BaseException) -> bool:
    # gloo reports a peer that closed its connection as a RuntimeError naming gloo; NCCL as a DistError
    return isinstance(e, dist.DistError) or any(word in str(e) for word in ("gloo", "NCCL", "Connection"))


def _out_of_memory(e: BaseException) -> bool:
    # CUDA's caching allocator raises torch.OutOfMemoryError; the CPU allocator a RuntimeError that says so
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in str(e)


def _when() -> str:
    return f"at step {Progress.step}" if Progress.step else "before the first step"


def _timeout_line() -> str:
    return (
        f"error: a collective waited longer than --timeout-s {Progress.timeout_s} {_when()}: another rank stopped, "
        f"hung or died; raise --timeout-s if a step can take that long, then continue with --resume"
    )


def _memory_line(e: BaseException) -> str:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        held = f"{torch.cuda.memory_allocated() / 1e9:.2f} GB allocated on GPU {torch.cuda.current_device()}"
    else:
        held = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9:.2f} GB resident at most"  # KiB
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return (
        f"out of memory {_when()} ({held}): {first} -- try a smaller --batch-size or --model-size, "
        f"FSDP (bash run_fsdp.sh shards the model's state), or --activation-checkpointing with FSDP"
    )
