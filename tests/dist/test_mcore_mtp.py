"""Multi-token prediction on the Megatron route (gloo, CPU), for every Megatron architecture with MTP rules (from the
registry, all in one spawn): DeepSeek-V3 and GLM-4.5 (the MTP layer stored as ``model.layers.{num_hidden_layers}.*``),
Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (the ``mtp.*`` head). A checkpoint with MTP tensors named as in the releases
converts HF -> Megatron -> HF bit-exact at TP=2, PP=2 (the MTP layer on the last stage) and, for the MoE models, EP=2,
and with the CLI (``hf-to-mcore --mtp`` and ``mcore-to-hf``); the MTP depth's per-token log-probs, loss and projection
gradient (``eh_proj``, the releases' ``eh_proj`` / ``fc``) equal an independent plain-torch MTP forward run on each
packed sequence alone (targets never cross into the next sequence); the main head's log-probs are bitwise those of
the model built without MTP, which drops the MTP tensors (the default), and equal transformers' fp32 forward. Also:
tiny Qwen3.5 with tied embeddings (its small releases), the same checks, the MTP depth scored with the tied head; a bf16
build against the fp32 reference; and the CLI on checkpoints whose MTP tensors do not fit (extra ones, none at all)."""

from __future__ import annotations

import os

import pytest
import torch

from actorcore.testing.distributed import run_distributed
from support.mtp import MTP_CONFIG_FIELDS, mtp_tensor_names, reference_mtp, write_mtp_checkpoint

pytest.importorskip("megatron.core")

LENGTHS = (9, 2, 12, 5, 3)  # a 2-token sequence has no MTP target, a 3-token one a single target
MTP_SCALE = 0.3
LAYERS = 2  # the tiny configs' decoder layers
TIED = "qwen3_5_text-tied"  # the small Qwen3.5 releases tie the embeddings: no lm_head.weight stored
BF16 = "qwen3_5_text"  # the case also built in bf16 (TP=2)


def _sequences() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(3, 131, (n,), generator=gen) for n in LENGTHS]


def _mtp_archs() -> list[str]:
    from actorcore.archs import get_spec
    from actorcore.mcore.build.model import megatron_model_types

    return [m for m in megatron_model_types() if get_spec(m).mcore.mtp is not None]


def _mtp_cases() -> dict[str, tuple[str, dict]]:
    """{case: (model_type, config overrides)}: every MTP architecture as its releases are, and Qwen3.5 tied."""
    return {**{m: (m, {}) for m in _mtp_archs()}, TIED: ("qwen3_5_text", dict(tie_word_embeddings=True))}


def _layouts(model_type: str) -> list[str]:
    from actorcore.archs import get_spec

    return ["tp2", "pp2"] + (["ep2"] if get_spec(model_type).mlp_kind == "moe" else [])


def _worker(rank: int, world_size: int, dirs: dict[str, tuple[str, str, str]]) -> dict:
    return {case: _arch_layouts(case, *case_dirs) for case, case_dirs in dirs.items()}


def _arch_layouts(case: str, model_type: str, mtp_dir: str, saved_dir: str) -> dict:
    """TP=2, PP=2 (the MTP layer on the last stage), EP=2 (its experts split): load, export, log-probs with the
    MTP loss (forward and backward); at TP=2 also the default build (MTP dropped), at PP=2 a Megatron checkpoint
    for the CLI; for the ``BF16`` case a bf16 build at TP=2 (forward)."""
    import actorcore as ac
    from megatron.core import parallel_state
    from transformers import AutoConfig

    from actorcore.mcore.cpu_runtime import CpuRuntime
    from actorcore.mcore.convert.dist_checkpoint import save_mcore_checkpoint
    from actorcore.mcore.run.forward import compute_logprobs, mtp_loss
    from actorcore.mcore.convert.load import checkpoint_expert_layout, load_hf_into_mcore
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from actorcore.mcore.convert.weight_stream import gather_hf_state_dict
    from support.mcore_cases import stapled_attributes

    hf_config = AutoConfig.from_pretrained(mtp_dir)
    layout = checkpoint_expert_layout(mtp_dir, hf_config)
    batch = ac.pack(_sequences())
    sizes = {"tp2": dict(tp=2), "pp2": dict(pp=2), "ep2": dict(ep=2)}
    out: dict = {}
    with CpuRuntime():
        for name in _layouts(model_type):
            parallel = McoreParallel(**sizes[name])
            context = initialize_megatron(parallel)
            model = build_gpt_model(hf_config, parallel, mtp=True, expert_layout=layout)
            load_hf_into_mcore(model, mtp_dir)
            result = compute_logprobs(model, batch, mtp_loss_scale=MTP_SCALE,
                                      loss_fn=lambda o, b: o.log_probs.sum() * 0.0)
            mtp_layers = [m for chunk in model.chunks if chunk.mtp_process for m in chunk.mtp.layers]
            got = dict(state=gather_hf_state_dict(model), log_probs=result.log_probs, stapled=stapled_attributes(model),
                       mtp=result.mtp_log_probs, loss=mtp_loss(result.mtp_log_probs, batch), tp_rank=context.tp_rank,
                       grads=[p.grad.clone() for n, p in model.chunks[-1].named_parameters()
                              if n.endswith("eh_proj.weight") and p.grad is not None],
                       mtp_blocks=[(type(m.transformer_layer.self_attention).__name__,
                                    type(m.transformer_layer.mlp).__name__) for m in mtp_layers])
            if name == "tp2":
                plain = build_gpt_model(hf_config, parallel, expert_layout=layout)  # the default: MTP tensors dropped
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
        if case == BF16:
            initialize_megatron(McoreParallel(tp=2))
            model = build_gpt_model(hf_config, McoreParallel(tp=2), torch.bfloat16, mtp=True, expert_layout=layout)
            load_hf_into_mcore(model, mtp_dir)
            result = compute_logprobs(model, batch, mtp_loss_scale=MTP_SCALE)
            out["bf16"] = dict(log_probs=result.log_probs, mtp=result.mtp_log_probs,
                               dtypes={p.dtype for chunk in model.chunks for p in chunk.parameters()})
            parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def mtp_world(tmp_path_factory):
    """Every case's checkpoint, its plain-torch reference, the two-rank results, and the CLI's conversions (both ways,
    and back from the PP=2 Megatron checkpoint)."""
    from actorcore.cli.convert import main as convert
    from support.checkpoints import load_checkpoint_tensors

    root = str(tmp_path_factory.mktemp("mcore_mtp"))
    dirs, references = {}, {}
    for case, (model_type, overrides) in _mtp_cases().items():
        os.makedirs(os.path.join(root, case))
        mtp_dir, donor_dir = write_mtp_checkpoint(os.path.join(root, case), model_type, **overrides)
        dirs[case] = (model_type, mtp_dir, os.path.join(root, case, "mcore-pp2"))
        references[case] = reference_mtp(mtp_dir, donor_dir, _sequences(), MTP_SCALE)
    results = run_distributed(_worker, 2, args=(dirs,))
    exported = {}
    for case, (_, mtp_dir, saved) in dirs.items():
        base = os.path.join(root, case)
        assert convert(["mcore-to-hf", saved, os.path.join(base, "back-pp2")]) == 0
        assert convert(["hf-to-mcore", mtp_dir, os.path.join(base, "mcore-cli"), "--mtp"]) == 0
        assert convert(["mcore-to-hf", os.path.join(base, "mcore-cli"), os.path.join(base, "back-cli")]) == 0
        exported[case] = {k: load_checkpoint_tensors(os.path.join(base, k)) for k in ("back-pp2", "back-cli")}
    return dict(archs=_mtp_archs(), dirs=dirs, references=references, results=results, exported=exported)


def test_mtp_archs_include_both_release_layouts(mtp_world):
    assert {"deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"} <= set(mtp_world["archs"])


@pytest.mark.parametrize("case", _mtp_cases())
def test_mtp_roundtrip_loss_and_packing(mtp_world, case):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from actorcore.archs import get_spec
    from actorcore.testing.tolerances import TOL

    model_type, mtp_dir, _ = mtp_world["dirs"][case]
    reference = load_file(os.path.join(mtp_dir, "model.safetensors"))
    # A tied checkpoint stores no head (the MTP depth's is the embedding), and none may be written back.
    assert ("lm_head.weight" in reference) == (case != TIED)
    for how, exported in mtp_world["exported"][case].items():  # the CLI, both ways: bit-exact
        assert sorted(exported) == sorted(reference), (case, how, set(exported) ^ set(reference))
        assert all(torch.equal(exported[k], v) and exported[k].dtype == v.dtype for k, v in reference.items()), how
        back = AutoConfig.from_pretrained(os.path.join(os.path.dirname(mtp_dir), how))
        # the MTP fields the release declares carried, none made up (Qwen3-Next's declares none)
        fields = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings")
        assert all(getattr(back, k, None) == MTP_CONFIG_FIELDS[model_type].get(k) for k in fields), how
        assert back.tie_word_embeddings == (case == TIED), how
    main_ref, mtp_rows, ref_loss, ref_grad = mtp_world["references"][case]
    mtp_names = mtp_tensor_names(model_type, reference, LAYERS)
    moe = get_spec(model_type).mlp_kind == "moe"
    # The MTP layer is a MoE layer in the MoE models (one tensor per expert, or stacked per layer).
    assert moe == any(".mlp.experts." in n for n in mtp_names), model_type
    ref_mtp = torch.cat(mtp_rows)
    results = [r[case] for r in mtp_world["results"]]
    for result in results:
        assert sorted(set(result) - {"bf16"}) == sorted(_layouts(model_type))
        for layout, got in result.items():
            if layout == "bf16":
                continue  # test_mtp_bf16_close_to_the_fp32_reference
            name = f"{case} {layout}"
            state = got["state"]
            assert got["stapled"] == [], got["stapled"]  # nothing of ours on Megatron's modules, MTP included
            assert sorted(state) == sorted(reference), (name, set(state) ^ set(reference))
            for key, tensor in reference.items():
                assert state[key].dtype == tensor.dtype and torch.equal(state[key], tensor), (name, key)
            # the MTP decoder layer: full attention (Megatron's), the MLP of the release's layer
            for attention, mlp in got["mtp_blocks"]:
                assert attention.endswith("SelfAttention") and mlp.endswith("MoELayer" if moe else "MLP"), (name, mlp)
            if layout == "tp2":
                assert set(got["plain_names"]) == set(reference) - mtp_names
                # The main head is unchanged by MTP (bitwise).
                assert torch.equal(got["log_probs"], got["plain"])
                assert "mtp=True" in got["refusal"]
            # ... and equals transformers' fp32 forward.
            torch.testing.assert_close(got["log_probs"], main_ref, atol=TOL["mcore_vs_hf_fp32"], rtol=0)
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
    assert any(r["pp2"]["grads"] and r["pp2"]["mtp_blocks"] for r in results)  # the last stage's
    assert all(r[layout]["grads"] and r[layout]["mtp_blocks"] for r in results for layout in r
               if layout not in ("pp2", "bf16"))


def test_mtp_bf16_close_to_the_fp32_reference(mtp_world):
    """A bf16 build with MTP (TP=2) runs, in bf16, and its main and MTP log-probs (float32) agree per token with the
    fp32 reference within the bf16 decoder's rounding."""
    from actorcore.testing.tolerances import TOL

    main_ref, mtp_rows, _, _ = mtp_world["references"][BF16]
    for result in mtp_world["results"]:
        got = result[BF16]["bf16"]
        assert got["dtypes"] == {torch.bfloat16}
        assert got["log_probs"].dtype == got["mtp"].dtype == torch.float32 and got["mtp"].shape == (1, sum(LENGTHS))
        torch.testing.assert_close(got["log_probs"], main_ref, atol=TOL["mcore_bf16_vs_hf_fp32"], rtol=0)
        torch.testing.assert_close(got["mtp"][0], torch.cat(mtp_rows), atol=TOL["mcore_bf16_vs_hf_fp32"], rtol=0)


def test_mtp_copy_that_differs_is_refused(tmp_path):
    """The release's MTP embedding / head copies must equal the main tensors bitwise (Megatron holds one)."""
    from safetensors.torch import save_file

    from actorcore.mcore.convert.load import _check_shared_copies
    from actorcore.mcore.convert.safetensors_reader import SafetensorsReader

    main = torch.randn(5, 3)
    changed = main.clone()
    changed[4, 2] += 1.0  # in the last rows: the share of the last rank of two
    save_file({"src": main, "same": main.clone(), "other": changed}, str(tmp_path / "model.safetensors"))
    reader, consumed = SafetensorsReader(str(tmp_path)), set()
    assert _check_shared_copies(reader, {"src": ["same"]}, consumed) == [] and consumed == {"same"}
    problems = _check_shared_copies(reader, {"src": ["other", "absent"]}, consumed)
    assert len(problems) == 2 and "other differs from src" in problems[0] and "missing tensor absent" in problems[1]


def test_mtp_refusals():
    """Asking for MTP where there is none, or under context parallelism, is a ValueError saying what to do; an MTP
    head the Megatron route cannot express is refused naming the config field."""
    from types import SimpleNamespace

    from actorcore.archs.spec import UnsupportedArchitectureError
    from actorcore.errors import UnsupportedConfigError
    from actorcore.mcore.run.forward import _check_mtp
    from actorcore.mcore.build.model import mtp_layer_count
    from actorcore.mcore.parallel import McoreParallel
    from actorcore.testing.tiny_configs import tiny_config

    assert mtp_layer_count(tiny_config("deepseek_v3", num_nextn_predict_layers=1), False) is None
    assert mtp_layer_count(tiny_config("deepseek_v3", num_nextn_predict_layers=1), True) == 1
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        mtp_layer_count(tiny_config("deepseek_v3", num_nextn_predict_layers=0), True)
    with pytest.raises(UnsupportedArchitectureError, match="multi-token-prediction"):
        mtp_layer_count(tiny_config("qwen3"), True)
    # Qwen3.5 counts mtp_num_hidden_layers, Qwen3-Next num_nextn_predict_layers (or that); one when neither is set.
    assert mtp_layer_count(tiny_config("qwen3_5_text", mtp_num_hidden_layers=1), True) == 1
    assert mtp_layer_count(tiny_config("qwen3_next"), True) == 1
    assert mtp_layer_count(tiny_config("qwen3_next", mtp_num_hidden_layers=1), True) == 1
    with pytest.raises(ValueError, match="mtp_num_hidden_layers >= 1"):
        mtp_layer_count(tiny_config("qwen3_5_moe_text", mtp_num_hidden_layers=0), True)
    with pytest.raises(UnsupportedConfigError, match=r"num_nextn_predict_layers=2 \(at most 1\).*one fc"):
        mtp_layer_count(tiny_config("qwen3_next", num_nextn_predict_layers=2), True)
    with pytest.raises(UnsupportedConfigError, match=r"mtp_num_hidden_layers=3 \(at most 1\)"):
        mtp_layer_count(tiny_config("qwen3_5_text", mtp_num_hidden_layers=3), True)
    with pytest.raises(UnsupportedConfigError, match="mtp_use_dedicated_embeddings=True.*embedding of its own"):
        mtp_layer_count(tiny_config("qwen3_5_text", mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=True), True)

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


def _with_tensors(src: str, dst: str, tensors: dict[str, torch.Tensor]) -> str:
    """A copy of the checkpoint ``src`` (config and all) holding ``tensors`` instead of its weights."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert "Traceback" not in err and len(errors) == 1, err
    return errors[0]


@pytest.mark.parametrize("what", ["unconsumed", "none"])
def test_mtp_tensors_that_do_not_fit_are_refused_leaving_nothing(mtp_world, tmp_path, capsys, what):
    """``hf-to-mcore --mtp`` (mtp=True) on a checkpoint whose ``mtp.*`` tensors do not fit the model: one nobody consumes
    (a second MTP layer, a misspelled fc) is an unexpected tensor, named; no MTP tensor at all (a checkpoint saved
    again by transformers) is refused saying so, naming what is missing, instead of building a random MTP head.
    Either way exit 2, one error line, and no output (nor a temporary one) left behind."""
    from safetensors.torch import load_file

    from actorcore.cli.convert import main as convert
    from actorcore.lifecycle import temp_prefix

    mtp_dir = mtp_world["dirs"]["qwen3_5_text"][1]
    state = load_file(os.path.join(mtp_dir, "model.safetensors"))
    if what == "unconsumed":
        tensors = {**state, "mtp.fcc.weight": state["mtp.fc.weight"].clone(),
                   "mtp.layers.1.input_layernorm.weight": state["mtp.layers.0.input_layernorm.weight"].clone()}
        expected = ["unexpected tensors", "mtp.fcc.weight", "mtp.layers.1.input_layernorm.weight"]
    else:
        tensors = {k: v for k, v in state.items() if not k.startswith("mtp.")}
        expected = ["holds no multi-token-prediction tensors", "mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight",
                    "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight", "mtp_num_hidden_layers=1", "drop --mtp"]
    src = _with_tensors(mtp_dir, str(tmp_path / what), tensors)
    dst = str(tmp_path / "out")
    assert convert(["hf-to-mcore", src, dst, "--mtp"]) == 2
    line = _error_line(capsys)
    assert all(fragment in line for fragment in expected), line
    assert not os.path.exists(dst) and not [n for n in os.listdir(tmp_path) if n.startswith(temp_prefix(dst))]


def test_mtp_tensors_dropped_with_a_warning_without_mtp(mtp_world, tmp_path, caplog):
    """Without --mtp (mtp=False) the checkpoint's MTP tensors are dropped with one warning naming them; the rest
    converts both ways bit-exact. (The main log-probs of that build are those of the MTP build, bitwise, and
    transformers': test_mtp_roundtrip_loss_and_packing, layout tp2.)"""
    from safetensors.torch import load_file

    from actorcore.cli.convert import main as convert
    from support.checkpoints import load_checkpoint_tensors

    model_type, mtp_dir, _ = mtp_world["dirs"]["qwen3_5_text"]
    state = load_file(os.path.join(mtp_dir, "model.safetensors"))
    dropped = mtp_tensor_names(model_type, state, LAYERS)
    with caplog.at_level("WARNING", logger="actorcore.mcore.convert.load"):
        assert convert(["hf-to-mcore", mtp_dir, str(tmp_path / "mcore")]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == "actorcore.mcore.convert.load"]
    assert len(warnings) == 1 and f"dropping the {len(dropped)} multi-token-prediction tensors" in warnings[0], warnings
    assert "mtp=True" in warnings[0] and "--mtp" in warnings[0]
    assert convert(["mcore-to-hf", str(tmp_path / "mcore"), str(tmp_path / "back")]) == 0
    back = load_checkpoint_tensors(str(tmp_path / "back"))
    assert sorted(back) == sorted(set(state) - dropped)
    assert all(torch.equal(back[k], state[k]) for k in back)
