"""``mcore_weight_stream``'s arguments are checked at the call (before any collective, so no rank hangs), and its
bucket plan keeps every bucket within the bound except a single larger tensor. The stream itself is tested over
gloo in tests/dist/test_mcore_export.py."""

from __future__ import annotations

import pytest
import torch

from actorcore.buckets import plan_buckets
from actorcore.mcore.weight_stream import mcore_weight_stream


class _Chunk:
    actorcore_hf_config = None


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(chunks=[]), "needs this rank's model chunks"),
    (dict(chunks=_Chunk()), "needs this rank's model chunks"),
    (dict(bucket_bytes=0), "bucket_bytes must be a positive int"),
    (dict(bucket_bytes=True), "bucket_bytes must be a positive int"),
    (dict(bucket_bytes=1.5e6), "bucket_bytes must be a positive int"),
    (dict(dtype=torch.int8), "dtype must be None or a floating torch.dtype"),
    (dict(dtype="bfloat16"), "dtype must be None or a floating torch.dtype"),
    (dict(context=None), "context must be the ParallelContext"),
])
def test_bad_arguments_are_refused_at_the_call(kwargs, fragment):
    from actorcore.parallel.context import ParallelContext

    args = {"chunks": [_Chunk()], "context": ParallelContext(), **kwargs}
    chunks, context = args.pop("chunks"), args.pop("context")
    with pytest.raises(ValueError, match=fragment):
        mcore_weight_stream(chunks, context, **args)  # not iterated: the error comes at the call


def test_plan_buckets_bound():
    sizes = [5, 5, 3, 20, 1, 1, 9, 10, 10]
    plan = plan_buckets(list(enumerate(sizes)), 10)
    assert [i for bucket in plan for i in bucket] == list(range(len(sizes)))  # every tensor once, in order
    assert plan == [[0, 1], [2], [3], [4, 5], [6], [7], [8]]
    for bucket in plan:
        assert sum(sizes[i] for i in bucket) <= 10 or len(bucket) == 1
