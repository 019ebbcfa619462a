"""quack's GPU tests: an autouse skip without quack, and proof that quack's kernels ran."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def needs_quack():
    pytest.importorskip("quack")
    from actorcore.kernels.quack.runtime import quack_refusal

    why = quack_refusal()
    if why is not None:
        pytest.skip(why)


def quack_kernels_ran(fn):
    """Run ``fn`` under the profiler; whether any CUDA kernel it launched is one of quack's (proof the path ran)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    return result, any("quack" in event.name for event in prof.events())
