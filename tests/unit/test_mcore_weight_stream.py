"""``mcore_weight_stream``'s arguments are checked at the call (before any collective, so no rank hangs), and its
bucket plan keeps every bucket within the bound except a single larger tensor. The stream itself is tested over
gloo in tests/dist/test_mcore_export.py."""

from __future__ import annotations

import pytest
import torch

from actorcore.buckets import plan_buckets
from actorcore.mcore.convert.weight_stream import mcore_weight_stream


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(model=[]), "takes the McoreModel"),
    (dict(model=[torch.nn.Linear(2, 2)]), "takes the McoreModel"),
    (dict(bucket_bytes=0), "bucket_bytes must be a positive int"),
    (dict(bucket_bytes=True), "bucket_bytes must be a positive int"),
    (dict(bucket_bytes=1.5e6), "bucket_bytes must be a positive int"),
    (dict(dtype=torch.int8), "dtype must be None or a floating torch.dtype"),
    (dict(dtype="bfloat16"), "dtype must be None or a floating torch.dtype"),
])
def test_bad_arguments_are_refused_at_the_call(kwargs, fragment):
    args = {"model": None, **kwargs}
    model = args.pop("model")
    with pytest.raises(ValueError, match=fragment):
        mcore_weight_stream(model, **args)  # not iterated: the error comes at the call


def test_plan_buckets_bound():
    sizes = [5, 5, 3, 20, 1, 1, 9, 10, 10]
    plan = plan_buckets(list(enumerate(sizes)), 10)
    assert [i for bucket in plan for i in bucket] == list(range(len(sizes)))  # every tensor once, in order
    assert plan == [[0, 1], [2], [3], [4, 5], [6], [7], [8]]
    for bucket in plan:
        assert sum(sizes[i] for i in bucket) <= 10 or len(bucket) == 1
