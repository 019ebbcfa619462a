"""Running a function on every rank of an NCCL group (one process per GPU) and collecting the results."""

from __future__ import annotations

import os
import tempfile

import torch


def nccl_entry(rank: int, world_size: int, directory: str, fn, args: tuple) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)  # NCCL object collectives use the current device
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl", init_method=f"file://{os.path.join(directory, 'rendezvous')}", rank=rank,
                            world_size=world_size, device_id=torch.device("cuda", rank))
    try:
        torch.save(fn(rank, world_size, *args), os.path.join(directory, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_nccl(fn, world_size: int, args: tuple) -> list:
    with tempfile.TemporaryDirectory() as directory:
        torch.multiprocessing.spawn(nccl_entry, args=(world_size, directory, fn, args), nprocs=world_size, join=True)
        return [torch.load(os.path.join(directory, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
