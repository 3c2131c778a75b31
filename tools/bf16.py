"""torch's ``bf16_compress_hook`` under another name, for torch DDP on gloo.

torch DDP refuses a hook named ``bf16_compress_hook`` or ``bf16_compress_wrapper_hook``
unless CUDA with NCCL 2.10+ (or XPU with XCCL) is present, though gloo sums bfloat16 on
the CPU. ``bf16_allreduce_hook`` does the same arithmetic (cast to bfloat16, divide by the
world size, all-reduce, copy back into the bucket), so torch DDP with it is the ground truth
for bucketddp with torch's hook. The benchmarks import it too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def bf16_allreduce_hook(group, bucket):  # type: ignore[no-untyped-def]
    """Average ``bucket`` over ``group`` (None: the default group) in bfloat16.

    Unannotated: torch DDP refuses annotations other than its own classes, and this
    module's annotations are strings.
    """
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    work = dist.all_reduce(compressed, group=group, async_op=True)

    def decompress(fut):  # type: ignore[no-untyped-def]
        return buffer.copy_(fut.value()[0])

    return work.get_future().then(decompress)
