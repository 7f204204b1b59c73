"""Copying a strategy: a training loop written here with torch alone, on a model this suite does not define (a
small MLP), imports each script's wrap (`apply_ddp`, `apply_fsdp` with `fsdp_mesh`, `apply_tp`, `apply_pipeline`
with `make_schedule`) and trains 10 steps on 4 gloo processes, in every form: each wrap over the 4 ranks, and with
data-parallel replicas (HSDP, FSDP x TP, pipeline replicas); every run follows the loop's own one-process run step
by step. docs/copying.md shows the same lines."""

import json
import sys

from tests.helpers import max_abs_diff
from tests.integration.early import Command

# The user's code: nothing of this suite but the four scripts' wraps
LOOP = """
import json, sys
import torch, torch.distributed as dist, torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from train_ddp import apply_ddp
from train_fsdp import apply_fsdp, fsdp_mesh
from train_pippy import apply_pipeline, make_schedule
from train_tp import apply_tp

STEPS, BATCH, MICRO = 10, 16, 4

def make_model():  # Linear, Tanh, Linear, Tanh, Linear, Tanh, Linear
    torch.manual_seed(0)
    sizes, layers = [12, 24, 24, 24, 5], []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])

TEACHER = torch.randn(12, 5, generator=torch.Generator().manual_seed(99))  # what the labels follow

def batch(step):  # the same global batch on every rank
    x = torch.randn(BATCH, 12, generator=torch.Generator().manual_seed(step))
    return x, (x @ TEACHER).argmax(dim=1)

def train(strategy, dp):
    rank, world = dist.get_rank(), dist.get_world_size()
    model, part, last, losses = make_model(), rank // (world // dp), True, []
    if strategy == "ddp":
        model, part = apply_ddp(model), rank
    elif strategy == "fsdp":
        model, part = apply_fsdp(model, fsdp_mesh("cpu", world, dp), units=[model[0], model[2]]), rank
    elif strategy == "tp":
        mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        model = apply_tp(model, mesh["tp"], plan, dp_mesh=mesh["dp"] if dp > 1 else None, dp_units=[model[0]])
    elif strategy == "pipeline":
        mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "pp"))
        pp, n = mesh.get_local_rank("pp"), world // dp
        cuts = [0, 4, 7] if n == 2 else [0, 2, 4, 6, 7]
        stage = nn.Sequential(*list(model)[cuts[pp]:cuts[pp + 1]])
        stages = apply_pipeline({pp: stage}, n, mesh.get_group("pp"), torch.device("cpu"),
                                dp_mesh=mesh["dp"] if dp > 1 else None)
        schedule = make_schedule("1f1b", stages, MICRO, lambda out, y: F.cross_entropy(out, y) / MICRO)
        model, last = stage, pp == n - 1
    parts = world if strategy in ("ddp", "fsdp") else dp
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        x, y = (t.chunk(parts)[part] for t in batch(step))
        if strategy == "pipeline":
            out = []
            schedule.step(*([x] if pp == 0 else []), target=y if last else None, losses=out if last else None)
            loss = sum(out) if last else torch.zeros(())
        else:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # every rank's mean (a pipeline: the last stages'), summed
        losses.append(total.item() / (world if strategy != "pipeline" else dp))
    return losses

dist.init_process_group("gloo")
world = dist.get_world_size()
FORMS = [("ddp", 1), ("fsdp", 1), ("tp", 1), ("pipeline", 1)]
FORMS += [("fsdp", 2), ("tp", 2), ("pipeline", 2)] if world > 2 else []  # HSDP, FSDP x TP, pipeline replicas
runs = {f"{strategy} dp{dp}": train(strategy, dp) for strategy, dp in FORMS}
if dist.get_rank() == 0:
    json.dump(runs, open(sys.argv[1], "w"))
dist.destroy_process_group()
"""


def one_process() -> list[float]:
    """The loop's own reference: the same model and batches on one process, no wrap."""
    import torch
    import torch.nn.functional as F

    namespace: dict = {}
    exec(LOOP.split("def train(")[0], namespace)  # make_model, batch: the user's own
    model = namespace["make_model"]()
    optimizer, losses = torch.optim.SGD(model.parameters(), lr=0.5), []
    for step in range(10):
        x, y = namespace["batch"](step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


# started with the session (tests/integration/early.py): the loop as `python -c`, on each of torchrun's 4 processes
STARTED = {
    "loop": Command(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "--no-python"]
        + [sys.executable, "-c", LOOP, "{out}/losses.json"],
        timeout_s=240,
    )
}


def test_every_wrap_copied_into_a_plain_loop_follows_one_process(early):
    reference = one_process()
    assert reference[-1] < 0.95 * reference[0]  # it learns, and far more than the tolerance: the check can fail
    out, _ = early.finished("copying/loop")
    runs = json.loads((out / "losses.json").read_text())
    # every wrap on 4 ranks (a pipeline of 4 stages), then 2 replicas of each: HSDP, FSDP x TP, pipeline x 2
    assert set(runs) == {"ddp dp1", "fsdp dp1", "tp dp1", "pipeline dp1", "fsdp dp2", "tp dp2", "pipeline dp2"}
    for name, losses in runs.items():
        assert max_abs_diff(losses, reference) <= 1e-5, (name, losses, reference)
