"""A DDP communication hook that makes each gradient element's all-reduce independent of DDP's bucket layout.

DDP lays its gradient buckets out in one order on a process's first backward and rebuilds them in the order
the gradients became ready after it. gloo sums each element in an order that depends on where the element
sits in the buffer it all-reduces, so a process resumed at step s (first layout) and the uninterrupted run
at step s (rebuilt layout) differ by an ulp, which AdamW grows. All-reducing each parameter's gradient as a
buffer of its own puts every element at the same place in every layout: resume is exact.
"""

import torch
import torch.distributed as dist


def allreduce_each_gradient(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket's gradients across ranks, one all-reduce per parameter (the views into the bucket's
    buffer are reduced in place, so the buffer DDP gets back holds the averages)."""
    group = process_group or dist.group.WORLD
    buffer = bucket.buffer().div_(dist.get_world_size(group))  # like DDP's own hook: average = sum of x / n
    works = [dist.all_reduce(grad, group=group, async_op=True) for grad in bucket.gradients()]
    return torch.futures.collect_all([work.get_future() for work in works]).then(lambda _: buffer)
