"""``BatchParams``: the per-micro-batch object actorcore's forward hands a Megatron model.

It is Megatron's ``PackedSeqParams`` (the THD layout every layer reads), plus what belongs to this call and this
batch: ``run_mtp`` (run the multi-token-prediction layers in this forward: an option of the call, read by the
post-processing ``mcore/build/model.py`` binds, never a flag on a module), ``cp_cache`` (the context-parallel
layout that the first attention layer derives and the others reuse), ``deepstack`` (Qwen3-VL: what each of the
first decoder layers adds to its output, ``mcore/build/vlm.py``) and ``layer_plan`` (the call's ``LayerPlan``: each
layer's recompute mode and the call's trace, read by ``mcore/build/layer.py``'s layers). It lives as long as the
micro-batch. ``rope_cache`` holds the per-token RoPE angles the compiled layers' core attention applies
(``mcore/build/fused_rope.py``), made by the first layer; ``rope`` is set on a layer's own copy, for its attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from actorcore.mcore.build.attention import CpLayoutCache
from actorcore.mcore.build.fused_rope import RopeCache

try:  # megatron-core is optional; this module is only imported by mcore/run/forward.py after require_megatron()
    from megatron.core.packed_seq_params import PackedSeqParams
except ImportError:  # pragma: no cover - guarded by require_megatron
    @dataclass
    class PackedSeqParams:  # type: ignore[no-redef]
        pass


@dataclass
class BatchParams(PackedSeqParams):
    run_mtp: bool = False
    cp_cache: CpLayoutCache = field(default_factory=CpLayoutCache)
    deepstack: tuple | None = None
    layer_plan: Any = None
    rope_cache: RopeCache = field(default_factory=RopeCache)
    rope: Any = None
