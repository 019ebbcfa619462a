"""Every error actorcore raises on purpose, in one place (the data layer: it imports nothing of actorcore).

Bad input is a ``ValueError`` subclass; a fast path that did not run is a ``FastPathNotRunError``; a peer that
stopped is a ``TransportError``; a missing optional dependency is an ``ImportError`` subclass.
"""

from __future__ import annotations


class UnsupportedArchitectureError(ValueError):
    """The model's architecture is not registered, or uses a feature actorcore refuses."""


class UnsupportedConfigError(UnsupportedArchitectureError):
    """The HF config uses a feature the Megatron route cannot reproduce exactly."""


class CheckpointError(ValueError):
    """The checkpoint cannot be read (damaged file, missing index, bad config)."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint's tensors do not match the model: names the missing, extra and mis-shaped tensors."""


class CheckpointPathError(CheckpointError):
    """A file the checkpoint names (an index entry, a link) lies outside the checkpoint's directory."""


class UnsafeCheckpointError(CheckpointError):
    """A pickled file of the checkpoint refers to something a checkpoint never contains."""


class VerificationError(ValueError):
    """actorcore's outputs differ from the model's own forward by more than the tolerance."""


class NonFiniteError(ValueError):
    """A decoder layer produced NaN or inf (``check_finite=True``), or the model's own forward did (``verify``)."""


class UnsupportedMegatronVersionError(ValueError):
    """The installed megatron-core is not a version the CPU shims were written for."""


class MegatronNotInstalledError(ImportError):
    """megatron-core is needed for the Megatron route and is not installed."""


class FastPathNotRunError(RuntimeError):
    """A fast path that was asked for did not run where it should have: the results would not be what was promised
    (e.g. a transformers upgrade bypassed a patch), so the call refuses to return them."""


class PackingNotAppliedError(FastPathNotRunError):
    """The packed attention did not run where it should have (e.g. a transformers change bypassed it)."""


class PatchNotAppliedError(FastPathNotRunError):
    """A patch applied by ``patch_model`` did not run where it should have. (Until this release it subclassed
    ``PackingNotAppliedError``, though a patch is not packing: catch ``FastPathNotRunError`` for both.)"""


class BatchInvariantNotAppliedError(FastPathNotRunError):
    """The batch-invariant forwards did not run where they should have (e.g. a module bypassed them)."""


class FiniteCheckNotRunError(FastPathNotRunError):
    """``check_finite=True`` was asked for but the per-layer checks did not run in every decoder layer."""


class VisionInputsNotAppliedError(FastPathNotRunError):
    """A vision-language model's decoder did not run on the embeddings with the visual features merged in."""


class TransportError(RuntimeError):
    """The other side stopped (its error, an interrupt, its process died) or did not answer in time."""


class EngineUpdateError(RuntimeError):
    """A rollout engine's weight update is partial, stale or unverified: the engine does not compute with the
    trainer's weights (the bridge blocks it from generating until an update succeeds)."""
