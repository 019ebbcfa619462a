"""Megatron's expert-parallel all-to-all overlapped with compute (``overlap_moe_expert_parallel_comm``): what
actorcore runs under it and what it refuses, before anything is built.

With the option, megatron-core 0.16.1's schedule for a forward-backward without pipelining is its combined 1F1B
(``combined_1f1b``): each micro-batch's forward runs layer by layer interleaved with the
previous micro-batch's backward, from the chunk's schedule plan (``GPTModel.build_schedule_plan``: attention,
token dispatch, experts and combine as separate nodes), the
all-to-alls on a second CUDA stream. ``actorcore.mcore.run.forward`` hands the schedule that plan for the same packed
batch; forward-only calls take the plain schedule. On the CPU the streams and events are no-ops
(``CpuRuntime``), so the two schedules compute the same operations: on gloo the log-probs, entropy and gradients
are bit-identical to the plain schedule's. The overlap itself only exists on CUDA.

Refused here (``UnsupportedConfigError``), each for a measured or stated reason:
- a float32 model: megatron-core asserts bf16 or fp16 for the option;
- ep = 1: megatron-core asserts expert parallelism (there is no all-to-all to hide);
- pp > 1: megatron-core then needs virtual pipeline stages and its interleaved combined schedule, not run here;
- cp > 1, VLM inputs, MTP layers: not run through the plan here (megatron-core's MTP node refuses packed
  sequences, and runs MTP in the plan only with pp > 1);
- a last decoder layer that is dense: the plan applies the final norm only at the end of a MoE layer's combine
  (0.16.1, ``submodule_combine_forward``), so after a dense last layer it is skipped: measured on gloo with
  Qwen3-MoE (``mlp_only_layers=[1]``): log-probs 0.32 off the plain schedule and no final-norm gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from actorcore.errors import UnsupportedConfigError

OPTION = "overlap_moe_expert_parallel_comm"


def check_ep_overlap(hf_config: Any, parallel: Any, dtype: torch.dtype, *, mtp: bool, vlm: bool,
                     config_overrides: dict[str, Any]) -> None:
    """Refuse ``overlap_moe_expert_parallel_comm=True`` where the combined 1F1B schedule would not compute what
    the plain schedule does (see the module docstring); nothing to check when the option is off."""
    if not config_overrides.get(OPTION):
        return
    from actorcore.mcore.build.config import mcore_fields

    pattern = mcore_fields(hf_config)[0].get("moe_layer_freq")
    missing = []
    if dtype not in (torch.bfloat16, torch.float16):
        missing.append(f"a bf16 or fp16 model (got {dtype}; megatron-core asserts it): pass dtype=torch.bfloat16")
    if parallel.ep < 2:
        missing.append(f"expert parallelism (ep >= 2, got ep={parallel.ep}): megatron-core has no all-to-all to "
                       "overlap without it")
    if parallel.pp > 1:
        missing.append(f"pp = 1 (got pp={parallel.pp}): the interleaved combined schedule with virtual stages is "
                       "not supported here")
    if parallel.cp > 1:
        missing.append(f"cp = 1 (got cp={parallel.cp}): context parallelism is not run through the schedule plan")
    if vlm:
        missing.append("a text model: VLM inputs are not run through the schedule plan")
    if mtp:
        missing.append("no MTP layers (mtp=False): megatron-core's MTP plan node refuses packed sequences")
    if not isinstance(pattern, list) or not pattern[-1]:
        missing.append("a MoE last decoder layer: megatron-core 0.16.1's schedule plan applies the final norm only "
                       f"after a MoE layer and would skip it after the dense last layer of {hf_config.model_type}")
    if missing:
        raise UnsupportedConfigError(f"{OPTION}=True (Megatron's combined 1F1B schedule) needs "
                                     + "; ".join(missing) + f". Drop {OPTION} to run the plain schedule")
