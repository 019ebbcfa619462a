"""Ulysses SP (``patch_model(parallel=ctx)``, sp=2 on 2 gloo processes) paired with every other ``patch_model``
option and with a batch-invariant call: each works as asked, per token against the model's own fp32 forward and per
parameter gradient (averaged over the SP group) with the trace proving both features ran, or is refused before any
work (``support.option_pairs``; the pairs without SP: ``tests/unit/test_patch_plan.py``). quack's GEMMs run
as the test stand-in; the compiled decoder and the ``torch_varlen`` and ``fa4`` attention backends are refused on the
CPU."""

from actorcore.testing.distributed import run_distributed
from support.option_pairs import ASKS

CPU_REFUSED = {"compiled_decoder": "not on a CUDA device", "torch_varlen": "runs fp16 / bf16 inputs on CUDA devices",
               "fa4": "FA4 runs on CUDA devices only"}  # SP on FA4's stand-in: tests/dist/test_fa4_sp.py


def _worker(rank, world_size):
    import torch.distributed as dist

    from actorcore.parallel import ParallelContext
    from support.option_pairs import (Tolerances, checkpointed, model_type_for, own_forward, run_pair,
                                                sequences)
    from actorcore.testing.quack_stand_in import use_quack_stand_in
    from actorcore.testing.tiny_configs import build_tiny_model
    from actorcore.testing.tolerances import TOL

    use_quack_stand_in()
    ctx = ParallelContext(sp_group=dist.new_group(list(range(world_size))))
    models, results = {}, {}
    for ask in ASKS:
        pair = ("sp", ask)
        kind = model_type_for(pair)
        if kind not in models:
            model = checkpointed(build_tiny_model(kind, seed=11))
            models[kind] = (model, own_forward(model, sequences()))
        model, want = models[kind]
        try:
            run_pair(model, pair, sequences(), want, Tolerances(TOL["sp_vs_single_fp32"], TOL["grad_sp_vs_single_fp32_rel"]),
                     parallel=ctx)
            results[ask] = "ok"
        except ValueError as exc:
            results[ask] = f"refused: {exc}"
        except AssertionError as exc:
            results[ask] = f"wrong: {exc}"
    return results


def test_sequence_parallel_with_every_other_option():
    for rank, results in enumerate(run_distributed(_worker, 2)):
        for ask, result in results.items():
            refused = CPU_REFUSED.get(ask)
            if refused is not None:
                assert result.startswith("refused") and refused in result, (rank, ask, result)
            else:
                assert result == "ok", (rank, ask, result)
