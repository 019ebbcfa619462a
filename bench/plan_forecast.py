"""What ``checkpointing="auto"`` would plan for the Qwen3-8B actor step at a budget, on 1, 2 and 4 FSDP2 ranks: the
planner's own arithmetic (``plan_layer_modes``) on the CPU, no model built. A forecast, not a measurement.

Per rank: the bf16 weights and gradients sharded, and (sharded) the root's embedding and head gathered and FSDP2's
whole copies (``parallel.fsdp_memory``: two layers' parameters, a layer's gradients and their reduce-scatter input, the
head's gradient whole); the layers' kept bytes per token as measured on one H100 (``--kept``, ``--gate-up``, KB per
token); activation offload of the fully checkpointed layers' inputs (``offload_activations="auto"``). A fully
checkpointed layer redoes its forward but the MLP's down projection (checkpointed inside its compiled graph), a
layer kept but for gate/up its gate/up GEMM.

    PYTHONPATH=src python3 bench/plan_forecast.py --pack-tokens 12288 --budget-gib 40
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from actorcore.hf.features.checkpointing import CallShape, CheckpointPlan, layer_forward_flops, plan_layer_modes

# Qwen3-8B: widths, layers, parameters (all, one decoder layer's, the untied head's)
CONFIG = SimpleNamespace(hidden_size=4096, num_attention_heads=32, head_dim=128, num_key_value_heads=8,
                         intermediate_size=12288)
LAYERS, PARAMS, LAYER_PARAMS, HEAD_PARAMS = 36, 8.19e9, 193e6, 151936 * 4096
CONTEXT = 1500.0  # tokens a token attends to on average in the bench's packs


def redone_shares() -> tuple[float, float]:
    """Of a layer's forward FLOPs: what a fully checkpointed compiled layer redoes, and a gate/up one."""
    whole = layer_forward_flops(CONFIG, CONTEXT)
    gate_up = 2 * CONFIG.hidden_size * 2 * CONFIG.intermediate_size
    return layer_forward_flops(CONFIG, CONTEXT, down_projection=False) / whole, gate_up / whole


def forecast(ranks: int, tokens: int, budget_gib: float, kept_kb: float, gate_up_kb: float) -> dict:
    bf16 = 2
    allocated = 2 * PARAMS * bf16 / ranks  # weights and gradients, this rank's shards
    copies, head_tail = 0.0, HEAD_PARAMS * bf16  # one rank: the head's gradient is the tail
    if ranks > 1:
        allocated += 2 * HEAD_PARAMS * bf16  # the root's embedding and head, gathered through the step
        copies, head_tail = 4 * LAYER_PARAMS * bf16 + HEAD_PARAMS * bf16, 0.0
    measured = {(i, mode): kb * 1e3 * 1.05 for i in range(LAYERS) for mode, kb in (("none", kept_kb),
                                                                                   ("gate_up", gate_up_kb))}
    shape = CallShape(tokens, bf16, allocated, CONTEXT, (CONFIG.intermediate_size,) * LAYERS, head_tail, (), 0.0,
                      copies)
    modes = plan_layer_modes(CheckpointPlan("auto", budget_gib * 2**30), [True] * LAYERS, shape, CONFIG, measured,
                             offloaded="auto")
    counts = {mode: modes.count(mode) for mode in ("full", "gate_up", "none")}
    full_share, gate_up_share = redone_shares()
    redone = full_share * counts["full"] + gate_up_share * counts["gate_up"]
    # model work of a step: 3 layer forwards' worth per layer (forward, backward), plus what is redone
    return dict(ranks=ranks, **counts, redone=redone, work=(3 * LAYERS + redone) / (3 * LAYERS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pack-tokens", type=int, default=12288)
    parser.add_argument("--budget-gib", type=float, default=40.0)
    parser.add_argument("--kept", type=float, default=115.0, help="KB per token a layer kept whole holds")
    parser.add_argument("--gate-up", type=float, default=63.0, help="KB per token a layer kept but for gate/up holds")
    args = parser.parse_args()
    print("ranks  full  gate_up  kept  forwards redone per pack  step's model work")
    print("(a full layer redoes %.2f of a forward, a gate/up one %.2f)" % redone_shares())
    for ranks in (1, 2, 4):
        r = forecast(ranks, args.pack_tokens, args.budget_gib, args.kept, args.gate_up)
        print(f"{r['ranks']:5d} {r['full']:5d} {r['gate_up']:8d} {r['none']:5d} {r['redone']:25.1f} {r['work']:17.3f}x")


if __name__ == "__main__":
    main()
