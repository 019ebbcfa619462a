"""The decoder features of the packed pass, in the order they enter a call (outermost first).

Each is one object of ``hf.decoder_feature.DecoderFeature`` (that module says how to write one). To add a
feature, write its object next to the code it drives and add it here: ``run_decoder`` enters it in every call
where it is ``active``, checks it after the forward, and ``patch_model`` calls its ``install``.

Order: the VLM inputs are built before anything else is in force (as the plain model builds them); the call's
checkpointing sets the layers' checkpoint functions before the offload wraps them; the offload
wraps the layers' checkpoint functions before the attention features wrap them again for the recomputation, so
the recomputation runs inside the offload's hooks; the finite checks see the layers' outputs last.
"""

from __future__ import annotations

from actorcore.hf.batch_invariant import BatchInvariant
from actorcore.hf.checkpointing import Checkpointing
from actorcore.hf.finite import FiniteChecks
from actorcore.hf.fused_decoder import FusedDecoder
from actorcore.hf.linear_attention import LinearAttention
from actorcore.hf.norm_recompute import RecomputedNorms
from actorcore.hf.offload import ActivationOffload
from actorcore.hf.packed_attention import PackedAttention
from actorcore.hf.tiled_mlp import TiledMLP
from actorcore.hf.vlm import VisionInputs

DECODER_FEATURES = (
    VisionInputs(),
    Checkpointing(),
    ActivationOffload(),
    PackedAttention(),
    LinearAttention(),
    BatchInvariant(),
    TiledMLP(),
    RecomputedNorms(),
    FusedDecoder(),
    FiniteChecks(),
)
