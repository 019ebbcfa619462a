"""TRL entry point: ``patch_trainer(trainer)`` puts a ``GRPOTrainer``'s (or ``RLOOTrainer``'s) per-token
log-probs and entropies on actorcore, for that trainer instance only; ``handle.revert()`` gives TRL's back.

Switch (trl 1.16)::

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data)
    handle = actorcore.compat.trl.patch_trainer(trainer)
    trainer.train()

What changes: TRL's ``_get_per_token_logps_and_entropies`` runs the model on padded ``[B, S]`` micro-batches
(left-padded prompts + right-padded completions) through its chunked LM head. The patched method packs the
rows without padding (``actorcore.compute_logprobs_padded``) and scores them with actorcore's fused fp32 head;
the policy model is patched with ``patch_model``'s plan (``patch_trainer(trainer, **options)``: the same options;
the fused decoder where ``"auto"`` takes it: a CUDA model with 16-bit weights, not under TRL's autocast of fp32
weights; budgeted checkpointing when asked for, in place of TRL's own in actorcore's calls); a separate reference
model (``ref_model``) runs the packed path unpatched. Everything else in TRL (generation, rewards, advantages, its
loss) is TRL's own.

The contract kept, exactly as trl 1.16 defines it: returns ``(log_probs, entropies, aux_loss)``; ``log_probs`` and
``entropies`` are ``[B, logits_to_keep]`` float32, position ``j`` holding token ``input_ids[:, S - logits_to_keep
+ j]``, 0 where ``attention_mask`` is 0; ``entropies`` is None unless ``compute_entropy``; ``aux_loss`` is None.
Logits are divided by ``trainer.temperature`` (after the model's own softcap / logit scale, as TRL does). Rows are
processed ``batch_size`` rows at a time as TRL does (the peak memory TRL's setting asks for); the image inputs of a
multimodal batch (Qwen2-VL / Qwen2.5-VL / Qwen3-VL / GLM-4V: ``pixel_values`` + ``image_grid_thw``) are split by
rows as TRL splits them (its ``num_images`` per row; without it the batch is packed whole) and packed through
actorcore's VLM packing. Refused with a ``ValueError``: the MoE load-balancing loss (``compute_aux_loss``), the
image inputs of other VLM families (``pixel_attention_mask``, ``spatial_shapes``, ``num_tiles``, ``image_sizes``,
``image_position_ids``, ``token_type_ids``), and image inputs that cannot be split (``pixel_values`` without
``image_grid_thw``, ``num_images`` that do not match the grids). LoRA (``peft_config``: the ``PeftModel``, also
with its adapters disabled for the reference) and gradient checkpointing go through unchanged. A model that
accelerate wrapped (DDP) is run inside the wrapper's forward, so that its gradient hooks apply (run on 2 gloo
ranks under accelerate's MULTI_CPU with DDP).

Weight sync to vLLM (``engine_sync``, default ``"auto"``): a trainer that generates with vLLM in colocate mode
(``GRPOConfig(use_vllm=True, vllm_mode="colocate")``) syncs the engine through TRL's ``vllm_generation.sync_weights``:
vLLM's ``model.load_weights`` per parameter, then a prefix-cache reset. That reruns none of the processing vLLM
applies after loading (on vLLM's CPU build, which repacks every linear, it fails half-way and leaves the engine part
new, part old), and nothing checks the result. With ``engine_sync`` on, this trainer's
``vllm_generation.sync_weights`` runs ``VllmBridge(llm).update(hf_weight_stream(model), reference=model)`` instead
(``actorcore.engines``: vLLM's reload protocol, the skipped post-processing rerun, every layer accounted for, the
prefix cache reset, a probe verified against the policy; a failure raises ``EngineUpdateError`` and blocks the
engine). A PEFT policy is streamed with its adapters merged; FSDP2 follows the stream's rule (every rank iterates,
each feeding its own colocated engine; not run with TRL: the tests run one process, ``GRPOTrainer`` only, though
``RLOOTrainer`` holds the same ``VLLMGeneration``). ``"auto"`` turns it on where that layout holds and leaves TRL's own sync,
with the reason in ``handle.engine_sync``, where it does not: no vLLM, server mode (TRL's server receives weights
through its own communicator, not actorcore's worker extension), sleep mode, an engine sharded over several ranks
(``vllm_tensor_parallel_size > 1``), FSDP1 or DeepSpeed ZeRO-3 (parameters the stream does not gather), a vLLM
outside the bridge's tested range. ``True`` refuses those with a ``ValueError``; ``False`` keeps TRL's sync.

Versions: trl 1.16 (the method's signature is checked at patch time; another signature is refused, and so is a
``VLLMGeneration`` without what the engine sync reads).
"""

from __future__ import annotations

import inspect
import logging
import types
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

TRAINER_METHOD = "_get_per_token_logps_and_entropies"
HANDLE_ATTR = "_actorcore_trl_patch"
TRAINER_CLASSES = ("GRPOTrainer", "RLOOTrainer")
# The keywords trl 1.16 passes; a TRL whose method takes others is refused at patch time (its contract moved).
TRL_ARGUMENTS = ("model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
                 "compute_aux_loss", "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask",
                 "spatial_shapes", "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids",
                 "image_position_ids")
UNSUPPORTED_IMAGE_INPUTS = ("pixel_attention_mask", "spatial_shapes", "num_tiles", "image_sizes", "token_type_ids",
                            "image_position_ids")
ENGINE_SYNC_CHOICES = (True, False, "auto")
ENGINE_SYNC_METHOD = "sync_weights"
ENGINE_SYNC_ATTR = "_actorcore_engine_sync"
# What trl 1.16's VLLMGeneration holds that the engine sync reads; one without them is refused at patch time.
VLLM_GENERATION_ATTRIBUTES = ("mode", "llm", "model", "accelerator", "enable_sleep_mode", "tensor_parallel_size",
                              "_dist")


@dataclass
class TrainerPatchHandle:
    """What ``patch_trainer`` changed on one trainer; ``revert()`` restores TRL's own method and the policy model
    (once).

    ``trace`` counts the patched calls (``trl:calls``) and actorcore's per-call trace keys (packed attention per
    layer, fused head, ``plan:<feature>`` per decoder feature that ran), so a test or a user can see that the fast
    path ran. ``model_patch``: the ``patch_model`` handle of the policy model (None where the model was patched
    before, and that patch is kept); ``plan``: the policy model's plan. ``engine_sync``: the ``engine_sync`` option
    resolved (a plan ``Decision``: on or off, and why); where on, ``engine_update`` is the latest sync's
    ``EngineUpdate`` and ``trace["trl:engine_syncs"]`` counts them. ``str(handle)`` prints both."""

    trainer: Any
    previous: Any = None
    had_own: bool = False
    trace: Counter = field(default_factory=Counter)
    model_patch: Any = None
    engine_sync: Any = None
    reverted: bool = False

    @property
    def plan(self) -> Any:
        from actorcore.hf.call import patch_state

        state = patch_state(self.trainer.accelerator.unwrap_model(self.trainer.model))
        return None if state is None else state.plan

    @property
    def engine_update(self) -> Any:
        """The latest engine sync's ``EngineUpdate`` (None before the first, or with ``engine_sync`` off)."""
        sync = _engine_sync_state(self.trainer)
        return None if sync is None else sync.last

    def __str__(self) -> str:
        plan = self.plan
        lines = [str(plan) if plan is not None else "actorcore patch plan: the policy model is not patched"]
        if self.engine_sync is not None:
            lines.append(f"  {self.engine_sync.line()}")
        return "\n".join(lines)

    def revert(self) -> None:
        if self.reverted:
            raise ValueError("this TRL patch was already reverted")
        if self.model_patch is not None:
            self.model_patch.revert()
        sync = _engine_sync_state(self.trainer)
        if sync is not None:
            sync.uninstall()
        _restore(self.trainer, TRAINER_METHOD, self.had_own, self.previous, HANDLE_ATTR)
        self.reverted = True
        logger.info("reverted actorcore's TRL patch on %s", type(self.trainer).__name__)


def _restore(instance: Any, method: str, had_own: bool, previous: Any, state_attr: str) -> None:
    """Give ``instance`` back the ``method`` it had before a patch (its own binding, or its class's) and drop the
    patch's state attribute."""
    state = instance.__dict__
    if had_own:
        state[method] = previous
    else:
        state.pop(method, None)
    state.pop(state_attr, None)


def _trl_trainer_classes() -> tuple[type, ...]:
    try:
        import trl
    except ImportError as err:
        raise ImportError("actorcore.compat.trl needs trl (pip install trl==1.16.0)") from err
    return tuple(getattr(trl, name) for name in TRAINER_CLASSES if hasattr(trl, name))


def _check_trainer(trainer: Any) -> None:
    classes = _trl_trainer_classes()
    if not isinstance(trainer, classes):
        raise ValueError(f"patch_trainer() takes a TRL {' or '.join(TRAINER_CLASSES)} instance, got "
                         f"{type(trainer).__name__}; other trainers compute log-probs elsewhere and are not patched")
    if HANDLE_ATTR in trainer.__dict__:
        raise ValueError("this trainer is already patched by actorcore; call handle.revert() before patching again")
    own = getattr(type(trainer), TRAINER_METHOD, None)
    params = tuple(inspect.signature(own).parameters)[1:] if own is not None else ()
    if params != TRL_ARGUMENTS:
        import trl

        raise ValueError(f"trl {trl.__version__}'s {type(trainer).__name__}.{TRAINER_METHOD} takes {params}, not "
                         f"trl 1.16's {TRL_ARGUMENTS}: this TRL version is not supported by actorcore.compat.trl "
                         "(pip install trl==1.16.0)")


def patch_trainer(trainer: Any, *, engine_sync: bool | str = "auto", **options: Any) -> TrainerPatchHandle:
    """Bind actorcore's per-token log-prob method on this trainer instance and patch its policy model with
    ``patch_model``'s plan (``options``: any ``patch_model`` option, e.g. ``checkpointing="auto",
    memory_budget_gib=40``; by default ``patch_model``'s defaults: the fused decoder where it runs and was measured,
    TRL's own gradient checkpointing); returns the handle (``revert()``; ``handle.plan``). A policy model patched
    before keeps its patch (then no options may be given). ``engine_sync`` (``"auto"``, ``True``, ``False``): the
    trainer's vLLM weight sync on actorcore's ``VllmBridge`` (module docstring; ``handle.engine_sync`` says what was
    decided and why)."""
    from actorcore.hf.patch import install_plan, is_patched, plan_patch

    _check_trainer(trainer)
    sync = plan_engine_sync(trainer, engine_sync)  # refusals before anything is installed
    model = trainer.accelerator.unwrap_model(trainer.model)
    if is_patched(model) and options:
        raise ValueError(f"the trainer's model is already patched by actorcore (patch_model): patch_trainer keeps "
                         f"that patch, so it takes no options ({sorted(options)}); revert the model's patch first "
                         "to have patch_trainer patch it with these")
    plan = None if is_patched(model) else plan_patch(model, by="compat.trl.patch_trainer", **options)
    model_patch = None if plan is None else install_plan(model, plan)
    state = trainer.__dict__
    handle = TrainerPatchHandle(trainer, previous=state.get(TRAINER_METHOD), had_own=TRAINER_METHOD in state,
                                model_patch=model_patch, engine_sync=sync)
    if sync.on:
        try:
            EngineSync.install(trainer.vllm_generation, handle.trace)
        except BaseException:
            if model_patch is not None:
                model_patch.revert()
            raise
    state[HANDLE_ATTR] = handle
    state[TRAINER_METHOD] = types.MethodType(per_token_logps_and_entropies, trainer)
    logger.info("%s computes per-token log-probs through actorcore (temperature %s); %s", type(trainer).__name__,
                trainer.temperature, sync.line())
    return handle


def plan_engine_sync(trainer: Any, engine_sync: bool | str) -> Any:
    """The ``engine_sync`` option resolved for this trainer (a plan ``Decision``; module docstring): ``"auto"`` is
    on where the trainer's vLLM runs colocated in the layout the bridge covers, else off with the reason;
    ``True`` there, else a ``ValueError`` with the reason; ``False`` keeps TRL's sync. A trainer with vLLM whose
    ``VLLMGeneration`` lacks what the sync reads is refused unless ``engine_sync=False``."""
    from actorcore.hf.features.plan import Decision, check_choice

    check_choice("engine_sync", engine_sync, ENGINE_SYNC_CHOICES,
                 "True puts the trainer's vLLM weight sync on actorcore's VllmBridge, False keeps TRL's, 'auto' "
                 "chooses the bridge where the trainer's vLLM runs colocated")
    asked = {"engine_sync": engine_sync}

    def decided(on: bool, why: str) -> Decision:
        return Decision("engine_sync", asked, "VllmBridge" if on else False, why, explicit=engine_sync != "auto",
                        by="compat.trl.patch_trainer")

    if engine_sync is False:
        return decided(False, "TRL's own sync_weights is kept, as asked")
    reason = _engine_sync_not_covered(trainer)
    if reason is None:
        return decided(True, "TRL's colocated vLLM sync (model.load_weights per parameter) replaced by "
                             "VllmBridge.update(hf_weight_stream(model), reference=model): vLLM's reload protocol, "
                             "its skipped post-processing rerun, every layer accounted for, the prefix cache reset, "
                             "a probe verified against the policy")
    if engine_sync is True:
        raise ValueError(f"engine_sync=True cannot hold for this trainer: {reason}. Pass engine_sync=False to keep "
                         "TRL's own weight sync (unverified), or 'auto' to use the bridge only where it applies")
    return decided(False, f"TRL's own sync_weights is kept: {reason}")


def _engine_sync_not_covered(trainer: Any) -> str | None:
    """Why the bridge cannot take this trainer's vLLM sync (None: it can). A ``VLLMGeneration`` of another layout
    than trl 1.16's is refused here outright."""
    if not getattr(trainer, "use_vllm", False):
        return "the trainer does not generate with vLLM (use_vllm=False): there is no engine to sync"
    generation = getattr(trainer, "vllm_generation", None)
    missing = [a for a in VLLM_GENERATION_ATTRIBUTES if not hasattr(generation, a)]
    own = getattr(type(generation), ENGINE_SYNC_METHOD, None)
    if missing or own is None or tuple(inspect.signature(own).parameters) != ("self",):
        import trl

        raise ValueError(f"trl {trl.__version__}'s trainer.vllm_generation ({type(generation).__name__}) is not trl "
                         f"1.16's VLLMGeneration (missing {missing or 'nothing'}; {ENGINE_SYNC_METHOD} "
                         f"{'absent' if own is None else inspect.signature(own)}): actorcore's engine sync covers trl "
                         "1.16 (pip install trl==1.16.0), or pass engine_sync=False to keep this TRL's own sync")
    if generation.mode != "colocate":
        return (f"vllm_mode={generation.mode!r}: TRL's vLLM server receives weights through TRL's own communicator, "
                "not actorcore's worker extension, so the bridge cannot reach it (vllm_mode='colocate' can)")
    if generation.enable_sleep_mode:
        return ("vllm_enable_sleep_mode=True: the engine's weights and KV cache are released between generations, "
                "and the bridge verifies an update by generating (untested with sleep mode)")
    if generation.tensor_parallel_size != 1:
        return (f"vllm_tensor_parallel_size={generation.tensor_parallel_size}: the engine is sharded over several "
                "trainer ranks (vLLM's external launcher); the bridge's colocated update is for one worker per engine")
    dist = generation._dist
    if getattr(dist, "zero_stage", 0) == 3 or getattr(dist, "fsdp_version", None) == 1:
        return ("DeepSpeed ZeRO-3 or FSDP1 shards the policy in a form hf_weight_stream does not gather (it gathers "
                "FSDP2 DTensors): use FSDP2, or keep TRL's sync")
    from actorcore.engines.vllm_worker import check_vllm_version

    try:
        check_vllm_version()
    except ValueError as exc:
        return str(exc)
    return None


@dataclass
class EngineSync:
    """actorcore's weight sync on one ``VLLMGeneration`` (kept on it; ``install`` / ``uninstall``): its
    ``VllmBridge``, the trainer handle's ``trace``, and the latest ``EngineUpdate``."""

    generation: Any
    bridge: Any
    trace: Counter
    previous: Any = None
    had_own: bool = False
    last: Any = None

    @classmethod
    def install(cls, generation: Any, trace: Counter) -> "EngineSync":
        from actorcore.engines.vllm import VllmBridge

        state = generation.__dict__
        if ENGINE_SYNC_ATTR in state:
            raise ValueError("this trainer's vllm_generation already syncs through actorcore; revert that patch first")
        sync = cls(generation, VllmBridge(generation.llm), trace, previous=state.get(ENGINE_SYNC_METHOD),
                   had_own=ENGINE_SYNC_METHOD in state)
        state[ENGINE_SYNC_ATTR] = sync
        state[ENGINE_SYNC_METHOD] = types.MethodType(sync_weights_through_bridge, generation)
        return sync

    def uninstall(self) -> None:
        _restore(self.generation, ENGINE_SYNC_METHOD, self.had_own, self.previous, ENGINE_SYNC_ATTR)


def _engine_sync_state(trainer: Any) -> EngineSync | None:
    generation = getattr(trainer, "vllm_generation", None)
    return None if generation is None else generation.__dict__.get(ENGINE_SYNC_ATTR)


def sync_weights_through_bridge(self: Any) -> None:
    """trl 1.16's ``VLLMGeneration.sync_weights`` on actorcore's ``VllmBridge`` (module docstring): bound on the
    instance. Raises ``EngineUpdateError`` (the engine blocked) where the update is partial or the engine does not
    compute with the policy's weights."""
    from actorcore.export.stream import hf_weight_stream

    sync: EngineSync = self.__dict__[ENGINE_SYNC_ATTR]
    model = self.accelerator.unwrap_model(self.model)
    sync.last = sync.bridge.update(hf_weight_stream(model), reference=model)
    sync.trace["trl:engine_syncs"] += 1
    logger.info("vLLM engine synced through actorcore's bridge: %d tensors, probe max |dlogp| %.2e",
                sync.last.tensors, sync.last.probe.max_abs)


def per_token_logps_and_entropies(self: Any, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                  logits_to_keep: int, batch_size: int | None = None, compute_entropy: bool = False,
                                  compute_aux_loss: bool = False, pixel_values: Any = None, image_grid_thw: Any = None,
                                  num_images: Any = None, mm_token_type_ids: Any = None, **other_inputs: Any):
    """trl 1.16's ``_get_per_token_logps_and_entropies`` on actorcore (module docstring): bound on the trainer."""
    if compute_aux_loss:
        raise ValueError("the MoE load-balancing loss (compute_aux_loss: trl 1.16 asks for it on every MoE config "
                         "unless router_aux_loss_coef is 0) is not computed by actorcore's TRL patch; build the "
                         "trainer with router_aux_loss_coef=0.0 in its GRPOConfig / RLOOConfig, or handle.revert()")
    given = sorted(k for k, v in other_inputs.items() if v is not None)
    if given:
        raise ValueError(f"image inputs {given} (VLM families other than Qwen-VL / GLM-4V) are not supported by "
                         "actorcore's TRL patch; handle.revert() to use TRL's own path for this model")
    trace = self.__dict__[HANDLE_ATTR].trace
    trace["trl:calls"] += 1
    total = input_ids.shape[0]
    has_images = pixel_values is not None or image_grid_thw is not None
    # Without TRL's per-row image counts the image inputs cannot be split by rows: the batch is packed whole.
    rows = total if has_images and num_images is None else (batch_size or total)
    inner = self.accelerator.unwrap_model(model)
    log_probs, entropies = [], []
    for start in range(0, total, rows):
        end = min(start + rows, total)
        multimodal = _multimodal_rows(start, end, num_images, pixel_values, image_grid_thw, mm_token_type_ids)
        with self.accelerator.autocast():
            out = _run_as_forward(model, inner, lambda: _scored(
                inner, input_ids[start:end], attention_mask[start:end], self.temperature, compute_entropy, trace,
                multimodal))
        log_probs.append(out[0][:, -logits_to_keep:])
        if compute_entropy:
            entropies.append(out[1][:, -logits_to_keep:])
    return torch.cat(log_probs), (torch.cat(entropies) if compute_entropy else None), None


def _multimodal_rows(start: int, end: int, num_images: list[int] | None, pixel_values: Any, image_grid_thw: Any,
                     mm_token_type_ids: Any) -> dict[str, Any]:
    """The image inputs of rows ``start:end``, split as trl 1.16 splits them: grids by ``num_images`` (images per
    row), pixel rows by the grids' ``t*h*w`` patches; rows without images get no image inputs."""
    out: dict[str, Any] = {}
    if mm_token_type_ids is not None:
        out["mm_token_type_ids"] = mm_token_type_ids[start:end]
    if pixel_values is None and image_grid_thw is None:
        return out
    if pixel_values is None or image_grid_thw is None:
        raise ValueError("TRL passed pixel_values without image_grid_thw (or the reverse): actorcore's TRL patch "
                         "packs the Qwen-VL / GLM-4V image inputs, which come as both; handle.revert() for this model")
    if num_images is None:
        return {**out, "pixel_values": pixel_values, "image_grid_thw": image_grid_thw}
    if len(num_images) < end or sum(num_images) != image_grid_thw.shape[0]:
        raise ValueError(f"num_images {num_images} does not match the {image_grid_thw.shape[0]} image grids and the "
                         f"batch's rows (at least {end}): pass one image count per row")
    first, last = sum(num_images[:start]), sum(num_images[:end])
    if first == last:
        return out
    patch_ends = torch.cat([image_grid_thw.new_zeros(1), image_grid_thw.prod(-1).cumsum(0)]).tolist()
    return {**out, "pixel_values": pixel_values[patch_ends[first]:patch_ends[last]],
            "image_grid_thw": image_grid_thw[first:last]}


def _scored(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float, entropy: bool,
            trace: Counter, multimodal: dict) -> tuple[torch.Tensor, ...]:
    """``[B, S]`` log-probs (and entropies) in the rows' own layout, a tuple (what a DDP wrapper can return)."""
    import actorcore

    out = actorcore.compute_logprobs_padded(model, input_ids, attention_mask, temperature=temperature, entropy=entropy,
                                  trace=trace, **multimodal)
    return (out.log_probs,) if out.entropy is None else (out.log_probs, out.entropy)


def _run_as_forward(wrapper: Any, inner: Any, fn: Any) -> Any:
    """Run ``fn`` inside ``wrapper``'s forward when accelerate wrapped the model (DDP: its forward prepares the
    gradient reduction); plain models run ``fn`` directly (``compute_logprobs`` runs as their own forward)."""
    if wrapper is inner:
        return fn()
    had_own, own = "forward" in inner.__dict__, inner.__dict__.get("forward")
    inner.forward = lambda actorcore_thunk: actorcore_thunk()
    try:
        return wrapper(actorcore_thunk=fn)
    finally:
        if had_own:
            inner.forward = own
        else:
            del inner.forward
