from actorcore.archs.spec import ArchSpec
from actorcore.archs.megatron_rules import DENSE_RULES, McoreSpec

SPEC = ArchSpec(model_type="llama", mcore=McoreSpec(rules=DENSE_RULES))
