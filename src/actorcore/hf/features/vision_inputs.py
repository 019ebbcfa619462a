"""The VLM-inputs decoder feature: a vision-language model's decoder runs on ``inputs_embeds`` with the vision
tower's features merged in (and Qwen3-VL's DeepStack inputs), built per call by ``hf.vlm.inputs``.

It counts ``vlm:inputs_embeds`` when it hands the decoder the merged embeddings, and the decoder's own use of its
input embedding inside the forward (``vlm:decoder_embedded_ids``); ``check`` requires the first and refuses the
second (the decoder would have embedded the token ids, without the visual features): ``VisionInputsNotAppliedError``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from actorcore.errors import VisionInputsNotAppliedError
from actorcore.hf.call import DecoderCall
from actorcore.hf.features.base import DecoderFeature
from actorcore.hf.vlm import inputs as vlm_inputs

INPUTS_EMBEDS_KEY = "vlm:inputs_embeds"
EMBEDDED_IDS_KEY = "vlm:decoder_embedded_ids"


class VisionInputs(DecoderFeature):
    """A VLM's decoder runs on ``inputs_embeds`` with the vision tower's features merged in (and DeepStack's)."""

    name = "vision_inputs"

    def active(self, call: DecoderCall) -> bool:
        return call.spec.vision is not None

    @contextlib.contextmanager
    def enter(self, call: DecoderCall) -> Iterator[None]:
        call.kwargs.update(vlm_inputs.vlm_decoder_inputs(call.model, call.spec, call.batch, call.parallel))
        if "inputs_embeds" in call.kwargs:
            call.kwargs.pop("input_ids", None)
            call.trace[INPUTS_EMBEDS_KEY] += 1

        def embedded_ids(module: Any, args: Any, output: Any) -> None:
            call.trace[EMBEDDED_IDS_KEY] += 1

        hook = call.model.get_input_embeddings().register_forward_hook(embedded_ids)
        try:
            yield
        finally:
            hook.remove()

    def check(self, call: DecoderCall) -> None:
        if call.ran(INPUTS_EMBEDS_KEY) < 1 or call.ran(EMBEDDED_IDS_KEY):
            raise VisionInputsNotAppliedError(
                f"{call.model_name}'s decoder did not run on the embeddings with the visual features merged in "
                f"({INPUTS_EMBEDS_KEY}={call.ran(INPUTS_EMBEDS_KEY)}, the decoder embedded token ids "
                f"{call.ran(EMBEDDED_IDS_KEY)} times itself); refusing to return results that ignore the images")
