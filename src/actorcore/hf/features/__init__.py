"""The decoder features of the packed pass, in the order they enter a call (outermost first).

Each is one object of ``base.DecoderFeature`` (that module says how to write one), in a module of this package
next to the code it drives, owning its ``patch_model`` options (``plan.FeatureOption``). To add a feature, write its
object and add it here: ``patch_model`` takes its options' keywords, resolves them into the patch's plan
(``plan.build_plan``) and calls its ``install``; ``hf.decoder.run_decoder`` enters it in every call where it is
``active`` (in this order, after the features it declares ``after``) and checks it after the forward.

The modules: ``base`` (the protocol), ``plan`` (the options and the patch plan), ``attention`` /
``ulysses_attention`` (actorcore's attention functions registered with transformers) and ``packed_attention``
(their feature), ``linear_attention`` (hybrid models' Gated DeltaNet), ``offload``, ``batch_invariant``,
``vision_inputs``, ``tiled_mlp``, ``norm_recompute``,
``finite``, ``checkpointing`` (full / selective / budgeted activation checkpointing), ``moe_experts`` (MoE
experts on grouped GEMMs with gather-only token moves), ``swiglu_mlp`` (SwiGLU MLPs on quack's gated GEMMs),
``compiled_decoder`` (compiled decoder layers on CUDA), ``instance_forwards`` (how features install per-instance
forwards and undo them) and ``class_paths`` (how features install a path per module, by class or through
transformers' ``ExpertsInterface``, and check it ran). ``fused_decoder`` and ``dense_mlp`` are the old paths of
``compiled_decoder`` and ``swiglu_mlp``, kept for one release.

Order (each feature declares what it enters ``after``): the VLM inputs are built before anything else is in force
(as the plain model builds them); the call's checkpointing sets the layers' checkpoint functions before the offload
wraps them; the offload wraps the layers' checkpoint functions before the attention and batch-invariant features
wrap them again for the recomputation, so the recomputation runs inside the offload's hooks; the finite checks see
the layers' outputs last.
"""

from __future__ import annotations

from actorcore.hf.features.base import entry_order
from actorcore.hf.features.batch_invariant import BatchInvariant
from actorcore.hf.features.checkpointing import Checkpointing
from actorcore.hf.features.compiled_decoder import CompiledDecoder
from actorcore.hf.features.finite import FiniteChecks
from actorcore.hf.features.linear_attention import LinearAttention
from actorcore.hf.features.moe_experts import MoeExperts
from actorcore.hf.features.norm_recompute import RecomputedNorms
from actorcore.hf.features.offload import ActivationOffload
from actorcore.hf.features.packed_attention import PackedAttention
from actorcore.hf.features.swiglu_mlp import SwigluMLP
from actorcore.hf.features.tiled_mlp import TiledMLP
from actorcore.hf.features.vision_inputs import VisionInputs

DECODER_FEATURES = entry_order((
    VisionInputs(),
    Checkpointing(),
    ActivationOffload(),
    PackedAttention(),
    LinearAttention(),
    BatchInvariant(),
    TiledMLP(),
    MoeExperts(),
    SwigluMLP(),
    RecomputedNorms(),
    CompiledDecoder(),
    FiniteChecks(),
))
