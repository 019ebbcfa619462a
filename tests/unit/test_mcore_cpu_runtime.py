"""``CpuRuntime``: megatron-core's CPU shims exist only inside the block; every patched attribute is the
original object again afterwards (also after an exception), nesting neither re-applies nor restores early,
and a megatron-core the shims were not written for is refused."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from actorcore.mcore import cpu_runtime  # noqa: E402
from actorcore.mcore.cpu_runtime import CpuRuntime, UnsupportedMegatronVersionError  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU runtime does nothing with CUDA")


ABSENT = object()  # 0.16.1's MoE router references te_general_gemm, which its module never defines


def _targets() -> list[tuple[object, str, object]]:
    return [(obj, name, getattr(obj, name, ABSENT)) for obj, name, _ in cpu_runtime._shims()]


def _assert_originals(before: list[tuple[object, str, object]]) -> None:
    for obj, name, original in before:
        assert getattr(obj, name, ABSENT) is original, f"{getattr(obj, '__name__', obj)}.{name} was not restored"
    assert "cuda" not in vars(torch.Tensor) and "record_stream" not in vars(torch.Tensor)


def test_shims_only_inside_the_block():
    before = _targets()
    runtime = CpuRuntime()
    with runtime:
        assert torch.cuda.current_device() == torch.device("cpu")
        x = torch.ones(2)
        assert x.cuda() is x
        assert {name for _, name, _ in runtime.replaced} == {name for _, name, _ in before}
        for obj, name, original in before:
            assert getattr(obj, name, ABSENT) is not original, name
    assert runtime.replaced == []
    _assert_originals(before)


def test_restored_after_an_exception():
    before = _targets()
    with pytest.raises(RuntimeError, match="inside"):
        with CpuRuntime():
            raise RuntimeError("inside")
    _assert_originals(before)


def test_nested_use_neither_reapplies_nor_restores_early():
    before = _targets()
    outer = CpuRuntime()
    with outer:
        shimmed = [(obj, name, getattr(obj, name, ABSENT)) for obj, name, _ in before]
        with CpuRuntime() as inner:  # another object: finds the outer one's shims
            assert inner.replaced == []
        with outer:  # the same object again: counts the depth
            pass
        for obj, name, value in shimmed:
            assert getattr(obj, name, ABSENT) is value, f"{name} restored early"
    _assert_originals(before)


def test_other_megatron_versions_are_refused(monkeypatch):
    cpu_runtime.check_megatron_version("0.16.1")
    cpu_runtime.check_megatron_version("0.16.0rc1")
    with pytest.raises(UnsupportedMegatronVersionError,
                       match=r"written for 0\.16\.x, but megatron-core 0\.17\.0 is installed"):
        cpu_runtime.check_megatron_version("0.17.0")
    before = _targets()
    monkeypatch.setattr(cpu_runtime, "installed_megatron_version", lambda: "0.15.2")
    with pytest.raises(UnsupportedMegatronVersionError, match="0.15.2"):
        with CpuRuntime():
            pass
    _assert_originals(before)


def test_te_absent_fixes_apply_on_any_device_and_are_undone():
    """Without TransformerEngine, megatron-core 0.16.1's MLA sees TE's placeholder classes as TE (``HAVE_TE``) and
    calls ``isinstance`` with a placeholder: a TypeError building DeepSeek-V3 on a GPU, where ``CpuRuntime`` does
    nothing. ``te_absent_fixes`` (used around model construction and the forward, on every device) turns that off
    and the MoE router's missing ``te_general_gemm`` on, for the block only."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.multi_latent_attention as mla

    from actorcore.mcore.cpu_runtime import te_absent_fixes

    if isinstance(mla.TELinear, type) or not mla.HAVE_TE:
        pytest.skip("this megatron-core's MLA sees no TE placeholder")
    before = (mla.HAVE_TE, getattr(moe_utils, "te_general_gemm", ABSENT))
    with te_absent_fixes():
        assert mla.HAVE_TE is False
        assert moe_utils.te_general_gemm is None
    assert (mla.HAVE_TE, getattr(moe_utils, "te_general_gemm", ABSENT)) == before
    with pytest.raises(RuntimeError), te_absent_fixes():
        raise RuntimeError("inside")
    assert (mla.HAVE_TE, getattr(moe_utils, "te_general_gemm", ABSENT)) == before
