"""Context parallelism (CP) by ring attention in a plain training loop: torch alone, nothing of this suite.

    torchrun --standalone --nproc-per-node 4 loops/cp.py   # 4-way CP: a GPU each + NCCL, else CPU + gloo
    python loops/cp.py                                      # 1 process: the ring is one rank, plain causal attention

Every rank trains on the same sequences, each on 1/cp of every sequence's tokens: chunk r and chunk 2 cp - 1 - r of
2 cp (a head and a tail: under the causal mask every rank has as much attention to compute). Attention is a ring:
the keys and values go round the ranks while each rank attends to the chunk it holds, and their gradients go round
with them in backward. The other loops' model has no sequence: this one is a tiny causal decoder of its own, on a
synthetic sequence task. Lines specific to CP are marked `# [CP]`; train_cp.py does the same (docs/copying.md).
"""

import argparse
import os
import sys
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, HIDDEN, N_BLOCKS, MAX_LEN = 16, 32, 2, 64, 2, 256
IGNORE = -100  # a target not scored (cross_entropy's ignore_index)
MAX_GRAD_NORM = 1.0  # the whole model's gradient is clipped to this L2 norm
LAST_MEETING: list[dist.Work] = []  # the teardown's all-reduce, kept until the process exits (main)


class Ring:  # [CP] this rank's place in the ring: its head and tail chunks, who it sends to and receives from
    def __init__(self) -> None:
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.right, self.left = (self.rank + 1) % self.size, (self.rank - 1) % self.size

    def positions(self, seq_len: int) -> torch.Tensor:  # the global positions of this rank's tokens
        c = seq_len // (2 * self.size)
        tail = 2 * self.size - 1 - self.rank
        return torch.cat([torch.arange(self.rank * c, (self.rank + 1) * c), torch.arange(tail * c, (tail + 1) * c)])

    def exchange(self, send: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start sending `send` to the right and receiving its like from the left; the function returned waits."""
        arriving = torch.empty_like(send)
        requests = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, send, self.right), dist.P2POp(dist.irecv, arriving, self.left)]
        )

        def received() -> torch.Tensor:
            for request in requests:
                request.wait()
            return arriving

        return received

    def blocks(self, source: int, t: int) -> tuple[slice, slice, bool]:
        # [CP] Which of my queries meet which of source's keys. Mine: all against all, causal (head before tail is
        # the global order). An earlier rank's head precedes both my chunks and its tail follows both: all my
        # queries against its head. A later rank's chunks both lie between my head and my tail: my tail against
        # all. Each is half of all against all: equal work on every rank
        all_, head, tail = slice(None), slice(0, t // 2), slice(t // 2, None)
        if source == self.rank:
            return all_, all_, True
        return (all_, head, False) if source < self.rank else (tail, all_, False)


def scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:  # q k^T / sqrt(D), masked if causal
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    return s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf")) if causal else s


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: softmax(q k^T / sqrt(D)) v and its rows' log-sum-exp, the merge's weight (q, k, v [B, H, t, D])."""
    s = scores(q, k, causal)
    lse = s.logsumexp(-1)
    return (s - lse[..., None]).exp() @ v, lse


def attend_backward(dout, q, out, lse, k, v, causal) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block, given the merged output and log-sum-exp of the queries' whole rows: then the
    block's softmax is its share of the rows', and the blocks' gradients add up to the whole attention's."""
    p = (scores(q, k, causal) - lse[..., None]).exp()
    ds = p * (dout @ v.transpose(-2, -1) - (dout * out).sum(-1, keepdim=True)) * q.shape[-1] ** -0.5  # softmax's
    return ds @ k, ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ dout


class RingAttention(torch.autograd.Function):  # [CP] causal attention of my queries over every rank's keys and values
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:
        out, lse = torch.zeros_like(q), q.new_full(q.shape[:3], float("-inf"))
        kv = torch.stack([k, v])  # [CP] one message a step, [2, B, H, t, D]
        for step in range(ring.size):
            source = (ring.rank - step) % ring.size  # whose chunks I hold now
            if step < ring.size - 1:
                received = ring.exchange(kv)  # [CP] the next chunks move while these are computed
            rows, cols, causal = ring.blocks(source, q.shape[2])
            block_out, block_lse = attend(q[:, :, rows], *kv[:, :, :, cols], causal)
            merged = torch.logaddexp(lse[:, :, rows], block_lse)  # [CP] the merge: each part by its share of the sum
            out[:, :, rows] = (
                out[:, :, rows] * (lse[:, :, rows] - merged).exp()[..., None]
                + block_out * (block_lse - merged).exp()[..., None]
            )
            lse[:, :, rows] = merged
            if step < ring.size - 1:
                kv = received()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        ring: Ring = ctx.ring
        dq, kv = torch.zeros_like(q), torch.stack([k, v])
        dkv = torch.zeros_like(kv)  # [CP] travels with kv, each rank adding its share: home after a whole round
        for step in range(ring.size):
            source = (ring.rank - step) % ring.size
            if step < ring.size - 1:
                received = ring.exchange(kv)  # [CP] the keys and values go round again
            rows, cols, causal = ring.blocks(source, q.shape[2])
            mine = (t[:, :, rows] for t in (dout, q, out, lse))
            dq_block, dk_block, dv_block = attend_backward(*mine, *kv[:, :, :, cols], causal)
            dq[:, :, rows] += dq_block
            dkv[:, :, :, cols] += torch.stack([dk_block, dv_block])
            if ring.size > 1:
                dkv = ring.exchange(dkv)()  # [CP] the gradient follows its chunk: the last send brings it home
            if step < ring.size - 1:
                kv = received()
        return dq, dkv[0], dkv[1], None


class Block(nn.Module):  # a transformer block: causal self-attention, then an MLP, each added to the residual stream
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.qkv, self.proj = nn.LayerNorm(DIM), nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.norm2, self.up, self.down = nn.LayerNorm(DIM), nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor, ring: Ring) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).unflatten(-1, (3, HEADS, -1)).permute(2, 0, 3, 1, 4)  # each [B, H, t, D]
        x = x + self.proj(RingAttention.apply(q, k, v, ring).transpose(1, 2).flatten(2))  # [CP] the ring's
        return x + self.down(torch.tanh(self.up(self.norm2(x))))


class Decoder(nn.Module):  # token and position embeddings, the blocks, the head: [B, t] tokens -> [B, t, VOCAB]
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(VOCAB, DIM), nn.Embedding(MAX_LEN, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(N_BLOCKS))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, ring: Ring) -> torch.Tensor:
        x = self.embed(tokens) + self.position(positions)  # [CP] positions: my tokens' places in the whole sequence
        for block in self.blocks:
            x = block(x, ring)
        return self.head(self.norm(x))


def make_model() -> Decoder:  # the same initial weights on every rank
    torch.manual_seed(0)
    return Decoder()


def global_batch(step: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same sequences on every rank: each counts up from a random start by its own random stride (mod VOCAB), so
    the next token follows from the last two; (tokens, the next tokens), each [batch_size, seq_len]. The first
    token's next is not scored (IGNORE): one token shows no stride."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(VOCAB, (batch_size, 1), generator=g)
    stride = torch.randint(1, VOCAB, (batch_size, 1), generator=g)
    sequences = (start + stride * torch.arange(seq_len + 1)) % VOCAB
    return sequences[:, :-1], sequences[:, 1:].index_fill(1, torch.tensor([0]), IGNORE)


def setup() -> torch.device:
    """Join torchrun's process group (without torchrun: a world of one); the device from LOCAL_RANK, never RANK."""
    local_rank, local_world_size = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.device_count() >= local_world_size:  # a GPU per process: NCCL
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))  # the processes share the cores
    if "RANK" in os.environ:
        dist.init_process_group(backend)  # torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return device


def fail(message: str) -> None:
    """Bad input: one line, from rank 0 (every rank finds it), and exit 2 before any process group exists."""
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def train(args: argparse.Namespace, device: torch.device) -> None:
    rank, cp = dist.get_rank(), dist.get_world_size()  # [CP] every rank is one of the ring's
    ring = Ring()  # [CP]
    positions = ring.positions(args.seq_len)  # [CP] my head and tail chunks' places in every sequence
    model = make_model().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)  # (SGD learns this task too slowly for 20 steps)
    for step in range(1, args.steps + 1):
        x, y = global_batch(step, args.batch_size, args.seq_len)  # [CP] the whole sequences, on every rank
        loss_sum = torch.zeros((), device=device)
        for xc, yc in zip(x.chunk(args.accum), y.chunk(args.accum)):
            scored = int((yc != IGNORE).sum())  # [CP] the whole sequences' scored positions, counted before the cut
            xc, yc = xc[:, positions].to(device), yc[:, positions].to(device)  # [CP] my tokens: inputs and targets
            logits = model(xc, positions.to(device), ring)
            # [CP] My share of the sequences' mean: my positions' sum over the whole sequences' count (my own mean
            # weighs the ranks wrongly: rank 0 holds the unscored first positions), x cp because the gradients are
            # averaged over the ranks below, as DDP and FSDP average them
            loss = F.cross_entropy(logits.flatten(0, 1), yc.flatten(), reduction="sum") * cp / scored
            loss = loss / args.accum  # summed over the chunks: the batch's mean
            loss.backward()
            loss_sum += loss.detach()
        # [CP] The ranks hold the same parameters and each has its tokens' part of their gradient: averaged, they
        # are the whole sequences' gradient, the same on every rank (one all-reduce a tensor: a tiny model; FSDP
        # over every rank, as train_cp.py has, shards them instead and averages them by its reduce-scatter)
        for p in model.parameters():
            dist.all_reduce(p.grad)  # [CP] (a sum: gloo has no average)
            p.grad /= cp  # [CP]
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss_sum)  # the ranks' shares, each x cp; / cp: the global batch's mean
        if rank == 0:
            loss, norm = loss_sum.item() / cp, grad_norm.item()
            print(f"step {step} loss {loss:.9f} grad_norm {norm:.9f} accumulated {args.accum}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Context parallelism (ring attention) in a plain training loop")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step, the same on every rank")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence, cut into 2 chunks per rank")
    parser.add_argument("--lr", type=float, default=0.01, help="Adam's learning rate")
    parser.add_argument("--accum", type=int, default=2, help="chunks of the sequences per step, gradients accumulated")
    args = parser.parse_args(argv)
    cp = int(os.environ.get("WORLD_SIZE", 1))
    if args.seq_len % (2 * cp) or not 0 < args.seq_len <= MAX_LEN:
        fail(
            f"--seq-len {args.seq_len}: {cp} ranks need {2 * cp} equal chunks; use a multiple of {2 * cp} to {MAX_LEN}"
        )
    if args.accum < 1 or args.batch_size % args.accum:
        fail(f"--batch-size {args.batch_size} --accum {args.accum}: {args.accum} chunks do not split the batch evenly")
    device = setup()
    try:
        train(args, device)
        # The ranks meet once more, and this process keeps the handle until it exits: on gloo, a process whose last
        # collective gloo's thread lets go of during the interpreter's exit aborts (docs/troubleshooting.md)
        LAST_MEETING.append(dist.all_reduce(torch.ones(1, device=device), async_op=True))
        LAST_MEETING[-1].wait()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
