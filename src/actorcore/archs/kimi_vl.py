from importlib.metadata import PackageNotFoundError, version

from actorcore.archs._vision import VisionSpec
from actorcore.archs.megatron_rules import McoreSpec
from actorcore.archs.spec import ArchSpec


def _installed_transformers() -> str:
    try:
        return version("transformers")
    except PackageNotFoundError:
        return "not installed"


REASON = (
    f"Kimi-VL is not shipped by the installed transformers ({_installed_transformers()}): it has no "
    "KimiVLConfig / KimiVLForConditionalGeneration, only remote code (trust_remote_code), whose layout and "
    "rope scheme actorcore cannot check against a reference; actorcore refuses it rather than guess. Supported "
    "VLMs: qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe, glm4v, glm4v_moe, and kimi_k25 (Kimi-K2.5, which "
    "transformers ships)"
)

# Registered only to refuse: every kimi_vl config has model_type "kimi_vl", so spec_for_model always raises.
SPEC = ArchSpec(
    model_type="kimi_vl",
    unsupported_config=(("model_type", REASON),),
    vision=VisionSpec(refused=REASON),
    mcore=McoreSpec(refused=REASON),
)
