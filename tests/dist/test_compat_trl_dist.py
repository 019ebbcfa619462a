"""TRL's GRPOTrainer on 2 gloo CPU ranks under accelerate (``use_cpu=True``: accelerate's MULTI_CPU, DDP), on
``actorcore.compat.trl.patch_trainer``.

Each rank is set up as ``torchrun --nproc_per_node 2`` sets it up (RANK / WORLD_SIZE / LOCAL_RANK, a gloo group);
accelerate takes that group and wraps the model in DDP. On the patch, ``trainer.train()`` runs two steps; then, on
each rank's own rollout batch, with the trained weights and through the trainer's DDP wrapper, the patched method's
per-token log-probs and entropies equal TRL's own (fp32), and the gradients of a loss on them equal the gradients
through TRL's own method, reduced over both ranks (equal on the two ranks although their batches differ: the
patched forward ran inside DDP's, so its gradient hooks applied; run outside it, the gradients differ by 2.9
relative). Seen here: ``accelerate launch --cpu --num_processes 2`` starts one process (DistributedType.NO):
accelerate's CPU multi-process launcher is ``mpirun`` (``--mpirun_hostfile``), which this machine lacks;
``torchrun --nproc_per_node 2`` with ``use_cpu=True`` gives accelerate MULTI_CPU with 2 processes.
"""

from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="trl not installed (pip install trl==1.16.0)")

from actorcore.parallel.spawn import run_distributed  # noqa: E402


def _gradients(model, method, ids, mask, keep):
    model.zero_grad(set_to_none=True)
    log_probs, _, _ = method(model, ids, mask, keep)
    (log_probs * mask[:, -keep:]).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.module.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _worker(rank, world_size, directory):
    from accelerate.utils import DistributedType

    from actorcore.compat.trl import patch_trainer
    from actorcore.testing.trl_cases import build_trainer, rollout, tiny_policy, trl_own

    model = tiny_policy(Path(directory) / "model", save=rank == 0)  # the reference TRL loads from the path
    torch.distributed.barrier()
    trainer = build_trainer(Path(directory) / f"rank{rank}", model=model, max_steps=2, num_generations=2, prompts=10)
    assert trainer.accelerator.num_processes == world_size
    assert trainer.accelerator.distributed_type == DistributedType.MULTI_CPU
    ids, mask, keep = rollout(trainer)  # this rank's rollout batch, drawn before training (eos is likely then)
    handle = patch_trainer(trainer)
    trainer.train()
    wrapped = trainer.model_wrapped
    assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel), type(wrapped)
    calls_in_training = handle.trace["trl:calls"]
    with torch.no_grad():
        want_lp, want_ent, _ = trl_own(trainer, wrapped, ids, mask, keep, compute_entropy=True)
        got_lp, got_ent, _ = trainer._get_per_token_logps_and_entropies(wrapped, ids, mask, keep, compute_entropy=True)
    ours = _gradients(wrapped, trainer._get_per_token_logps_and_entropies, ids, mask, keep)
    trls = _gradients(wrapped, lambda *a: trl_own(trainer, *a), ids, mask, keep)
    grad_rel = max(((ours[n] - g).abs().max() / g.abs().max().clamp(min=1e-30)).item() for n, g in trls.items())
    return dict(calls_in_training=calls_in_training, logp_diff=(got_lp - want_lp).abs().max().item(),
                entropy_diff=(got_ent - want_ent).abs().max().item(), grad_rel=grad_rel, grad_names=sorted(ours),
                trl_grad_names=sorted(trls), padding_zero=bool((got_lp[mask[:, -keep:] == 0] == 0).all()),
                ids=ids, embed_grad=ours["model.embed_tokens.weight"],
                weights=torch.cat([p.detach().flatten() for p in trainer.model.parameters()]),
                losses=[r["loss"] for r in trainer.state.log_history if "loss" in r])


@pytest.mark.dist
def test_grpo_trainer_on_two_gloo_ranks_equals_trls_own_per_token_and_in_gradients(tmp_path):
    from actorcore.testing.tolerances import TOL

    results = run_distributed(_worker, 2, args=(str(tmp_path),))
    for r in results:
        assert r["calls_in_training"] > 0  # the training steps' log-probs came from actorcore
        assert len(r["losses"]) == 2 and all(torch.isfinite(torch.tensor(r["losses"])))
        assert r["logp_diff"] <= TOL["packed_vs_hf_fp32"] and r["entropy_diff"] <= TOL["packed_vs_hf_fp32"]
        assert r["padding_zero"]
        assert r["grad_names"] == r["trl_grad_names"] and r["grad_names"]
        assert r["grad_rel"] <= TOL["grad_packed_vs_hf_fp32_rel"], r["grad_rel"]
    assert not torch.equal(results[0]["ids"], results[1]["ids"])  # the ranks scored different batches ...
    torch.testing.assert_close(results[0]["embed_grad"], results[1]["embed_grad"], rtol=0, atol=1e-7)  # ... reduced
    assert torch.equal(results[0]["weights"], results[1]["weights"])  # DDP kept the replicas equal over training
