"""compat.verl under Ulysses SP on 2 gloo ranks, driven the way verl 0.7.1's dp_actor / dp_critic drive it:
each rank pads and slices the remove-padding inputs (``ulysses_pad_and_slice_inputs``), calls the patched
forward with its slice, and gathers the outputs itself (``gather_outputs_and_unpad``). Per token, the gathered
outputs equal the unpatched model run one sequence at a time, and the parameter gradients averaged over the SP
group (what FSDP over dp x sp does) equal one process's.

verl is not importable here (its package pulls ray and more), so its few pure-torch helpers are copied below from
verl 0.7.1's ``verl/utils/ulysses.py`` (``ulysses_pad``, ``slice_input_tensor``, ``Gather``,
``gather_outputs_and_unpad``), shortened to the arguments verl's actor passes.

Lengths 6 + 1 + 13 + 5 = 25 tokens: verl pads one token, and the slice edge (13) falls inside a sequence.
"""

import sys
import types

import torch

from actorcore.testing.distributed import run_distributed
from actorcore.testing.tolerances import TOL

LENGTHS = (6, 1, 13, 5)
TEMPERATURE = 0.7


# ---- copied from verl 0.7.1 verl/utils/ulysses.py (pure torch) ----
def ulysses_pad(input_ids_rmpad, position_ids_rmpad=None, sp_size=1, pad_value=0):
    if sp_size <= 1:
        return input_ids_rmpad, position_ids_rmpad, 0
    _, total_seq_len = input_ids_rmpad.shape
    pad_size = (sp_size - total_seq_len % sp_size) % sp_size
    if pad_size > 0:
        input_ids_rmpad = torch.nn.functional.pad(input_ids_rmpad, (0, pad_size), value=pad_value)
        if position_ids_rmpad is not None:
            pad_pos_ids = torch.arange(pad_size, device=position_ids_rmpad.device).unsqueeze(0)
            position_ids_rmpad = torch.cat((position_ids_rmpad, pad_pos_ids), dim=-1)
    return input_ids_rmpad, position_ids_rmpad, pad_size


def slice_input_tensor(x, dim, group):
    import torch.distributed as dist

    sp_world_size, sp_rank = dist.get_world_size(group), dist.get_rank(group)
    parts = x.size(dim) // sp_world_size
    slc = [slice(None)] * len(x.shape)
    slc[dim] = slice(sp_rank * parts, (sp_rank + 1) * parts)
    return x[tuple(slc)].contiguous()


def ulysses_pad_and_slice_inputs(input_ids_rmpad, position_ids_rmpad, sp_size, group):
    input_ids_rmpad, position_ids_rmpad, pad_size = ulysses_pad(input_ids_rmpad, position_ids_rmpad, sp_size)
    input_ids_rmpad = slice_input_tensor(input_ids_rmpad, 1, group)
    if position_ids_rmpad is not None:
        position_ids_rmpad = slice_input_tensor(position_ids_rmpad, 1, group)
    return input_ids_rmpad, position_ids_rmpad, pad_size


class Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, local_tensor, gather_dim, grad_scaler=True):
        import torch.distributed as dist

        ctx.group, ctx.gather_dim, ctx.grad_scaler = group, gather_dim, grad_scaler
        ctx.sp_world_size, ctx.sp_rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.part_size = local_tensor.size(gather_dim)
        parts = [torch.empty_like(local_tensor) for _ in range(ctx.sp_world_size)]
        dist.all_gather(parts, local_tensor.contiguous(), group=group)
        return torch.cat(parts, dim=gather_dim)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.grad_scaler:
            grad_output = grad_output * ctx.sp_world_size
        return None, grad_output.split(ctx.part_size, dim=ctx.gather_dim)[ctx.sp_rank].contiguous(), None, None


def gather_outputs_and_unpad(x, gather_dim, unpad_dim, padding_size, group):
    x = Gather.apply(group, x, gather_dim, True)
    if padding_size == 0:
        return x
    slc = [slice(None)] * len(x.shape)
    slc[unpad_dim] = slice(0, -padding_size)
    return x[tuple(slc)]
# ---- end of the copy ----


def _sequences():
    g = torch.Generator().manual_seed(21)
    return [torch.randint(3, 131, (n,), generator=g) for n in LENGTHS]


def _rmpad(seqs):
    return torch.cat(seqs)[None], torch.cat([torch.arange(len(s)) for s in seqs])[None]


def _fake_verl(group):
    """A stand-in ``verl.utils.ulysses`` holding verl's Ulysses group (verl's parallel state), for this process."""
    verl, utils, ulysses = (types.ModuleType(n) for n in ("verl", "verl.utils", "verl.utils.ulysses"))
    ulysses.get_ulysses_sequence_parallel_group = lambda: group
    verl.utils, utils.ulysses = utils, ulysses
    sys.modules.update({"verl": verl, "verl.utils": utils, "verl.utils.ulysses": ulysses})


def _avg_grads(model, group, sp):
    import torch.distributed as dist

    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g, group=group)
        grads[name] = g / sp
    return grads


def _grad_rel(grads, reference):
    return max(((grads[n] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-30)).item()
               for n, p in reference.named_parameters() if p.grad is not None)


def _worker(rank, world_size):
    import torch.distributed as dist

    from actorcore.compat.verl import apply_monkey_patch
    from actorcore.testing.tiny_configs import build_tiny_model

    group = dist.new_group(list(range(world_size)))
    seqs = _sequences()
    ids, pos = _rmpad(seqs)
    rolled = torch.roll(ids, shifts=-1, dims=1)  # verl's labels: the next token (across the sequence end)
    ids_s, pos_s, pad = ulysses_pad_and_slice_inputs(ids, pos, world_size, group)
    rolled_s, _, _ = ulysses_pad_and_slice_inputs(rolled, None, world_size, group)
    last = torch.cumsum(torch.tensor(LENGTHS), 0) - 1  # each sequence's last token predicts nothing
    weights = 0.5 + torch.rand(ids.shape[1], generator=torch.Generator().manual_seed(3))
    result = {}

    # Actor, fused kernels, SP group from (a stand-in for) verl's parallel state.
    _fake_verl(group)
    reference = build_tiny_model("qwen3", seed=5)
    ref_lp = []
    for s in seqs:
        logp = torch.log_softmax(reference(input_ids=s[None]).logits[0] / TEMPERATURE, -1)
        lp = torch.zeros(len(s))
        lp[:-1] = logp[:-1].gather(-1, s[1:, None])[:, 0]
        ref_lp.append(lp)
    ref_lp = torch.cat(ref_lp)
    (ref_lp * weights).sum().backward()
    model = build_tiny_model("qwen3", seed=5)
    apply_monkey_patch(model, world_size, True, True)
    out = model(input_ids=ids_s, position_ids=pos_s, attention_mask=None, use_cache=False, temperature=TEMPERATURE,
                return_dict=True, shift_labels=rolled_s)  # verl 0.9's engine passes its sliced rolled labels
    assert out.log_probs.shape == ids_s.shape, (out.log_probs.shape, ids_s.shape)
    lp = gather_outputs_and_unpad(out.log_probs.squeeze(0), 0, 0, pad, group)
    (lp * weights).sum().backward()
    result["fused_lp"] = (lp.detach() - ref_lp).abs().max().item()
    result["fused_last_zero"] = bool((lp.detach()[last] == 0).all())
    result["fused_grad"] = _grad_rel(_avg_grads(model, group, world_size), reference)

    # Actor without fused kernels: verl divides the logits in place and takes log-probs of its rolled labels.
    for name in ("verl", "verl.utils", "verl.utils.ulysses"):
        sys.modules.pop(name)
    reference = build_tiny_model("gemma2", seed=6)  # final logit softcap
    ref_logits = torch.cat([reference(input_ids=s[None]).logits[0] for s in seqs]) / TEMPERATURE
    ref_lp = torch.log_softmax(ref_logits, -1).gather(-1, rolled[0, :, None])[:, 0]
    (ref_lp * weights).sum().backward()
    model = build_tiny_model("gemma2", seed=6)
    apply_monkey_patch(model, ulysses_sp_size=world_size, use_fused_kernels=False, sp_group=group)
    out = model(input_ids=ids_s, position_ids=pos_s, attention_mask=None, use_cache=False)
    logits = out.logits.squeeze(0)
    logits.div_(TEMPERATURE)
    local_lp = torch.log_softmax(logits, -1).gather(-1, rolled_s[0, :, None])[:, 0]
    lp = gather_outputs_and_unpad(local_lp, 0, 0, pad, group)
    (lp * weights).sum().backward()
    full_logits = gather_outputs_and_unpad(logits.detach(), 0, 0, pad, group)
    result["logits"] = (full_logits - ref_logits.detach()).abs().max().item()
    result["logits_grad"] = _grad_rel(_avg_grads(model, group, world_size), reference)

    # Critic (dp_critic): output.logits [1, total_nnz / sp, 1], gathered and unpadded along tokens.
    reference = build_tiny_model("llama", task="token_classification", seed=8)
    ref_values = torch.cat([reference(input_ids=s[None]).logits[0, :, 0] for s in seqs])
    (ref_values * weights).sum().backward()
    model = build_tiny_model("llama", task="token_classification", seed=8)
    apply_monkey_patch(model, ulysses_sp_size=world_size, sp_group=group)
    out = model(input_ids=ids_s, position_ids=pos_s, attention_mask=None, use_cache=False)
    assert out.logits.shape == (1, ids_s.shape[1], 1), out.logits.shape
    values = gather_outputs_and_unpad(out.logits.squeeze(0), 0, 0, pad, group).squeeze(-1)
    (values * weights).sum().backward()
    result["values"] = (values.detach() - ref_values.detach()).abs().max().item()
    result["values_grad"] = _grad_rel(_avg_grads(model, group, world_size), reference)
    return result


def test_verl_ulysses_slices_in_slices_out_match_one_process():
    assert sum(LENGTHS) % 2 == 1 and 6 + 1 < (sum(LENGTHS) + 1) // 2 < 6 + 1 + 13  # a pad; an edge inside seq 3
    tol, grad_tol = TOL["sp_vs_single_fp32"], TOL["grad_sp_vs_single_fp32_rel"]
    for rank, r in enumerate(run_distributed(_worker, 2)):
        where = f"rank {rank}"
        assert r["fused_lp"] <= tol and r["fused_last_zero"], (where, r)
        assert r["logits"] <= tol and r["values"] <= tol, (where, r)
        for key in ("fused_grad", "logits_grad", "values_grad"):
            assert r[key] <= grad_tol, (where, key, r[key])
