"""The conventional baseline: BabyCNN trained the way most DDP tutorials do it, for the benchmark to beat; --model gpt:
BabyGPT in nanoGPT's plain loop (`python -m bench --model gpt` sets it beside train_ddp.py).

    python -m bench.baseline --out runs/baseline --max-steps 100
    torchrun --standalone --nproc-per-node 4 -m bench.baseline --out runs/baseline

docs/performance.md says what it does the tutorials' way; diff it against train_ddp.py. It writes metrics.jsonl (plus
`data_time_s`, the wait for the DataLoader) and run.json, as the scripts do."""

import argparse
import json
import os
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

from common.data import NORMALISATION
from common.digits import make_digits
from common.language import COPY_VOCAB, make_copy
from common.model import build_model
from common.recorder import measure_memory, write_run_json


class DigitImages(Dataset):
    """What torchvision.datasets.MNIST.__getitem__ does: a PIL image per sample, then the transform."""

    def __init__(self, images: torch.Tensor, targets: torch.Tensor, transform) -> None:
        self.data, self.targets, self.transform = images, targets, transform

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        img, target = self.data[index], int(self.targets[index])
        img = Image.fromarray(img.numpy(), mode="L")
        return self.transform(img), target


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.baseline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-steps", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=128, help="global batch")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--train-size", type=int, default=12800)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--model", choices=("cnn", "gpt"), default="cnn")
    parser.add_argument("--seq-len", type=int, default=64, help="gpt: tokens per sequence of the copy task")
    args = parser.parse_args(argv)

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if args.model == "gpt":  # nanoGPT's get_batch: each step random sequences indexed from the tensors, no DataLoader
        tokens, targets = make_copy(args.train_size, args.seq_len, seed=args.seed)
        picks, sampler = torch.Generator().manual_seed(args.seed + rank), None
        shape = (args.train_size // args.batch_size, args.batch_size // world_size)  # an epoch's steps, rank's share
        model = build_model(model="gpt", seed=args.seed, vocab_size=COPY_VOCAB, seq_len=args.seq_len, dropout=0.1)
    else:
        images, labels = make_digits(args.train_size, seed=args.seed)
        mean, std = NORMALISATION["digits"]
        transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
        dataset = DigitImages(images[:, 0], labels, transform)
        sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True) if distributed else None
        loader = DataLoader(
            dataset,
            batch_size=args.batch_size // world_size,
            shuffle=sampler is None,
            sampler=sampler,
            num_workers=args.num_workers,
            drop_last=True,
        )
        model = build_model(seed=args.seed, in_channels=1, image_size=28, num_classes=10, dropout=0.1)
    if distributed:
        model = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "metrics.jsonl"), "w") if rank == 0 else None
    step, started_run = 0, time.perf_counter()
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)  # a different shuffle each epoch, the same on every rank
        picked = torch.randint(args.train_size, shape, generator=picks) if args.model == "gpt" else None
        batches = iter(loader) if picked is None else ((tokens[i], targets[i]) for i in picked)  # (gpt: sequences)
        while not args.max_steps or step < args.max_steps:
            started = time.perf_counter()
            try:
                images, labels = next(batches)
            except StopIteration:
                break
            data_time = time.perf_counter() - started
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images).flatten(0, -2), labels.flatten())  # (gpt: every position's)
            loss.backward()
            optimizer.step()
            loss_value = loss.item()  # this rank's loss: the tutorials log rank 0's, not the global mean
            step += 1
            step_time = time.perf_counter() - started
            if log:
                record = {"kind": "train", "step": step, "loss": loss_value, "lr": args.lr,
                          "samples_per_s": args.batch_size / step_time, "step_time_s": step_time,
                          "data_time_s": data_time}  # fmt: skip
                log.write(json.dumps(record) + "\n")
                log.flush()
    memory = {"rank": rank, **measure_memory(model.parameters(), optimizer, torch.device("cpu"))}
    per_rank: list[Any] = [memory] * world_size
    if distributed:
        dist.all_gather_object(per_rank, memory)
    if rank == 0:
        log.close()
        final, threads = {"wall_time_s": time.perf_counter() - started_run}, torch.get_num_threads()
        run = dict(strategy="baseline", world_size=world_size, threads_per_process=threads, config=vars(args))
        write_run_json(args.out, **run, final=final, memory={"per_rank": per_rank})
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
