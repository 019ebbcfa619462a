"""Multi-token prediction on the Megatron route (gloo, CPU), for every Megatron architecture with MTP rules
(DeepSeek-V3, GLM-4.5; from the registry, all in one spawn): a checkpoint with MTP tensors named as in the
releases (``model.layers.{num_hidden_layers}.*``) converts HF -> Megatron -> HF bit-exact at TP=2, PP=2 and
EP=2; the MTP depth's per-token log-probs, loss and ``eh_proj`` gradient equal an independent plain-torch MTP
forward run on each packed sequence alone (targets never cross into the next sequence); the main head's log-probs
are bitwise those of the model built without MTP, which drops the MTP tensors (the default)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from actorcore.testing.distributed import run_distributed
from actorcore.testing.mtp import reference_mtp, write_mtp_checkpoint

pytest.importorskip("megatron.core")

LENGTHS = (9, 2, 12, 5, 3)  # a 2-token sequence has no MTP target, a 3-token one a single target
MTP_SCALE = 0.3


def _sequences() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(3, 131, (n,), generator=gen) for n in LENGTHS]


def _mtp_archs() -> list[str]:
    from actorcore.archs import get_spec
    from actorcore.mcore.model import megatron_model_types

    return [m for m in megatron_model_types() if get_spec(m).mcore.mtp is not None]


def _worker(rank: int, world_size: int, dirs: dict[str, tuple[str, str]]) -> dict:
    return {model_type: _arch_layouts(mtp_dir, saved_dir) for model_type, (mtp_dir, saved_dir) in dirs.items()}


def _arch_layouts(mtp_dir: str, saved_dir: str) -> dict:
    """TP=2, PP=2 (the MTP layer on the last stage), EP=2 (its experts split): load, export, log-probs with the
    MTP loss (forward and backward); at TP=2 also the default build (MTP dropped), at PP=2 a Megatron checkpoint
    for the CLI."""
    import actorcore as ac
    from megatron.core import parallel_state
    from transformers import AutoConfig

    from actorcore.mcore.cpu_runtime import CpuRuntime
    from actorcore.mcore.load import load_hf_into_mcore
    from actorcore.mcore.dist_checkpoint import save_mcore_checkpoint
    from actorcore.mcore.forward import compute_logprobs, mtp_loss
    from actorcore.mcore.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from actorcore.mcore.weight_stream import gather_hf_state_dict
    from actorcore.testing.mcore_cases import stapled_attributes

    hf_config = AutoConfig.from_pretrained(mtp_dir)
    batch = ac.pack(_sequences())
    out: dict = {}
    with CpuRuntime():
        for name, parallel in (("tp2", McoreParallel(tp=2)), ("pp2", McoreParallel(pp=2)),
                               ("ep2", McoreParallel(ep=2))):
            context = initialize_megatron(parallel)
            model = build_gpt_model(hf_config, parallel, mtp=True)
            load_hf_into_mcore(model, mtp_dir)
            result = compute_logprobs(model, batch, mtp_loss_scale=MTP_SCALE,
                                      loss_fn=lambda o, b: o.log_probs.sum() * 0.0)
            got = dict(state=gather_hf_state_dict(model), log_probs=result.log_probs, stapled=stapled_attributes(model),
                       mtp=result.mtp_log_probs, loss=mtp_loss(result.mtp_log_probs, batch), tp_rank=context.tp_rank,
                       grads=[p.grad.clone() for n, p in model.chunks[-1].named_parameters()
                              if n.endswith("eh_proj.weight") and p.grad is not None])
            if name == "tp2":
                plain = build_gpt_model(hf_config, parallel)  # the default: MTP tensors dropped
                load_hf_into_mcore(plain, mtp_dir)
                got["plain"] = compute_logprobs(plain, batch).log_probs
                got["plain_names"] = sorted(gather_hf_state_dict(plain))
                try:
                    compute_logprobs(plain, batch, mtp_loss_scale=1.0)
                except ValueError as exc:
                    got["refusal"] = str(exc)
            elif name == "pp2":
                save_mcore_checkpoint(model, saved_dir, mtp_dir)
            out[name] = got
            parallel_state.destroy_model_parallel()
    return out


def test_mtp_roundtrip_loss_and_packing():
    from actorcore.cli.convert import main as convert
    from actorcore.testing.checkpoints import load_checkpoint_tensors

    archs = _mtp_archs()
    assert {"deepseek_v3", "glm4_moe"} <= set(archs)
    with tempfile.TemporaryDirectory() as root:
        dirs, donors = {}, {}
        for model_type in archs:
            os.makedirs(os.path.join(root, model_type))
            mtp_dir, donors[model_type] = write_mtp_checkpoint(os.path.join(root, model_type), model_type)
            dirs[model_type] = (mtp_dir, os.path.join(root, model_type, "mcore-pp2"))
        results = run_distributed(_worker, 2, args=(dirs,))
        for model_type, (mtp_dir, saved) in dirs.items():
            back = os.path.join(root, model_type, "back")
            # The Megatron checkpoint written at PP=2 (MTP on the last stage) converts back with the CLI, bit-exact.
            assert convert(["mcore-to-hf", saved, back]) == 0
            _check_arch(model_type, mtp_dir, donors[model_type], load_checkpoint_tensors(back),
                        [r[model_type] for r in results])


def _check_arch(model_type: str, mtp_dir: str, donor_dir: str, exported: dict, results: list[dict]) -> None:
    from safetensors.torch import load_file

    from actorcore.testing.tolerances import TOL

    reference = load_file(os.path.join(mtp_dir, "model.safetensors"))
    main_ref, mtp_rows, ref_loss, ref_grad = reference_mtp(mtp_dir, donor_dir, _sequences(), MTP_SCALE)
    assert sorted(exported) == sorted(reference), model_type
    assert all(torch.equal(exported[k], v) and exported[k].dtype == v.dtype for k, v in reference.items())
    layers = 2
    mtp_names = {n for n in reference if n.startswith(f"model.layers.{layers}.")}
    assert f"model.layers.{layers}.mlp.experts.3.up_proj.weight" in mtp_names  # the MTP layer is a MoE layer
    ref_main = main_ref
    ref_mtp = torch.cat(mtp_rows)
    for result in results:
        for layout, got in result.items():
            name = f"{model_type} {layout}"
            state = got["state"]
            assert got["stapled"] == [], got["stapled"]  # nothing of ours on Megatron's modules, MTP included
            assert sorted(state) == sorted(reference), (name, set(state) ^ set(reference))
            for key, tensor in reference.items():
                assert state[key].dtype == tensor.dtype and torch.equal(state[key], tensor), (name, key)
            if layout == "tp2":
                assert set(got["plain_names"]) == set(reference) - mtp_names
                # The main head is unchanged by MTP (bitwise).
                assert torch.equal(got["log_probs"], got["plain"])
                assert "mtp=True" in got["refusal"]
            # ... and equals transformers' fp32 forward.
            torch.testing.assert_close(got["log_probs"], ref_main, atol=TOL["mcore_vs_hf_fp32"], rtol=0)
            # MTP depth 1, per token, against the per-sequence reference: 0 at each sequence's first two tokens.
            assert got["mtp"].shape == (1, sum(LENGTHS)), name
            starts = torch.tensor([0, *LENGTHS[:-1]]).cumsum(0)
            assert torch.all(got["mtp"][0, starts] == 0) and torch.all(got["mtp"][0, starts + 1] == 0), name
            torch.testing.assert_close(got["mtp"][0], ref_mtp, atol=TOL["mcore_vs_hf_fp32"], rtol=0)
            torch.testing.assert_close(got["loss"], ref_loss, atol=TOL["mcore_vs_hf_fp32"], rtol=0)
            # The MTP loss's gradient in eh_proj (column-parallel: this TP rank's rows).
            for grad in got["grads"]:
                rows = grad.shape[0]
                expected = ref_grad[got["tp_rank"] * rows:(got["tp_rank"] + 1) * rows]
                scale = expected.abs().max()
                torch.testing.assert_close(grad / scale, expected / scale, atol=TOL["grad_mcore_vs_hf_fp32_rel"],
                                           rtol=0)
    assert any(r["pp2"]["grads"] for r in results)
    assert all(r["tp2"]["grads"] and r["ep2"]["grads"] for r in results)


def test_mtp_copy_that_differs_is_refused(tmp_path):
    """The release's MTP embedding / head copies must equal the main tensors bitwise (Megatron holds one)."""
    from safetensors.torch import save_file

    from actorcore.mcore.load import _check_shared_copies
    from actorcore.mcore.safetensors_reader import SafetensorsReader

    main = torch.randn(5, 3)
    changed = main.clone()
    changed[4, 2] += 1.0  # in the last rows: the share of the last rank of two
    save_file({"src": main, "same": main.clone(), "other": changed}, str(tmp_path / "model.safetensors"))
    reader, consumed = SafetensorsReader(str(tmp_path)), set()
    assert _check_shared_copies(reader, {"src": ["same"]}, consumed) == [] and consumed == {"same"}
    problems = _check_shared_copies(reader, {"src": ["other", "absent"]}, consumed)
    assert len(problems) == 2 and "other differs from src" in problems[0] and "missing tensor absent" in problems[1]


def test_mtp_refusals():
    """Asking for MTP where there is none, or under context parallelism, is a ValueError saying what to do."""
    from types import SimpleNamespace

    from actorcore.archs.spec import UnsupportedArchitectureError
    from actorcore.mcore.forward import _check_mtp
    from actorcore.mcore.model import mtp_layer_count
    from actorcore.mcore.parallel import McoreParallel
    from actorcore.testing.tiny_configs import tiny_config

    assert mtp_layer_count(tiny_config("deepseek_v3", num_nextn_predict_layers=1), False) is None
    assert mtp_layer_count(tiny_config("deepseek_v3", num_nextn_predict_layers=1), True) == 1
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        mtp_layer_count(tiny_config("deepseek_v3", num_nextn_predict_layers=0), True)
    with pytest.raises(UnsupportedArchitectureError, match="multi-token-prediction"):
        mtp_layer_count(tiny_config("qwen3"), True)
    def model(cp: int, mtp_layers: int = 1) -> SimpleNamespace:  # what _check_mtp reads of an McoreModel
        return SimpleNamespace(mtp_layers=mtp_layers, parallel=McoreParallel(cp=cp),
                               config=SimpleNamespace(pipeline_model_parallel_layout=None))

    assert _check_mtp(model(cp=1), 0.5) == 1
    assert _check_mtp(model(cp=1), None) == 0
    with pytest.raises(ValueError, match="mtp=True"):
        _check_mtp(model(cp=1, mtp_layers=0), 0.5)
    with pytest.raises(ValueError, match="context parallelism"):
        _check_mtp(model(cp=2), 0.5)
    with pytest.raises(ValueError, match="non-negative"):
        _check_mtp(model(cp=1), -1.0)
