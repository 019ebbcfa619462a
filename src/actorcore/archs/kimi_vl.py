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
    "rope scheme actorcore cannot check against a reference; actorcore refuses it rather than guess. Kimi-K2.5 "
    "(kimi_k25), which transformers ships, is supported; `actorcore models` lists every supported VLM"
)

# Registered only to refuse: every kimi_vl config has model_type "kimi_vl", so spec_for_model always raises.
SPEC = ArchSpec(
    model_type="kimi_vl",
    unsupported_config=(("model_type", REASON),),
    vision=VisionSpec(refused=REASON),
    mcore=McoreSpec(refused=REASON),
)
