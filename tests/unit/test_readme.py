"""The README's quickstart runs as written, and what it prints is the model's own forward, per token."""

import contextlib
import io

import torch

from support.docs import doc_between
from actorcore.testing.tolerances import TOL


def _own_forward(model, sequences):
    """Each sequence alone through the model's own forward, log-softmax in fp32 (0 at the first token)."""
    log_probs, entropies = [], []
    with torch.no_grad():
        for ids in sequences:
            logp = torch.log_softmax(model(ids[None]).logits[0, :-1].float(), dim=-1)
            log_probs += [torch.zeros(1), logp.gather(1, ids[1:, None])[:, 0]]
            entropies += [torch.zeros(1), -(logp.exp() * logp).sum(-1)]
    return torch.cat(log_probs), torch.cat(entropies)


def test_quickstart_runs_as_written():
    code = doc_between("README.md", "## Quickstart\n\n```python\n", "```\n")
    assert 8 <= len(code.splitlines()) <= 16, "the quickstart is meant to be read in a minute"
    namespace: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md:quickstart", "exec"), namespace)
    model, batch, out = namespace["model"], namespace["batch"], namespace["out"]
    sequences = [torch.tensor([1, 5, 9, 4]), torch.tensor([2, 7, 3])]
    assert torch.equal(batch.input_ids, torch.cat(sequences))
    ref_lp, ref_ent = _own_forward(model, sequences)
    assert out.log_probs.dtype == torch.float32 and out.log_probs.shape == (7,)
    assert (out.log_probs.detach() - ref_lp).abs().max() <= TOL["packed_vs_hf_fp32"]
    assert (out.entropy.detach() - ref_ent).abs().max() <= TOL["packed_vs_hf_fp32"]
    assert all(p.grad is not None for p in model.model.layers.parameters())
    assert "tensor(" in printed.getvalue()
