"""An autouse fixture for GPU tests whose fp32 references must not run their matmuls in TF32."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def exact_fp32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old
