from actorcore.archs.spec import ArchSpec

SPEC = ArchSpec(model_type="llama")
