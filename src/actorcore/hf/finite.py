"""Finite checks (``check_finite=True``): raise ``NonFiniteError`` at the first module whose output holds NaN or
inf, instead of returning NaN log-probs.

Forward hooks on the input embedding and on every decoder layer, for one call, test each output; each test counts
``finite:checked`` in the call's trace. After the forward, the ``FiniteChecks`` feature requires one per decoder
layer (else the hooks were bypassed and nothing was checked) and tests the decoder's final output (its norm).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from actorcore.errors import FiniteCheckNotRunError, NonFiniteError
from actorcore.hf.call import DecoderCall
from actorcore.hf.decoder_feature import DecoderFeature

FINITE_KEY = "finite:checked"


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return getattr(output, "last_hidden_state", None)


@contextlib.contextmanager
def finite_checks(call: DecoderCall) -> Iterator[None]:
    """Forward hooks that raise ``NonFiniteError`` at the first module whose output is not finite."""
    handles = []

    def hook(name: str) -> Callable:
        def check(module: Any, args: Any, output: Any) -> None:
            tensor = _first_tensor(output)
            if tensor is None:
                return
            call.trace[FINITE_KEY] += 1
            if not bool(torch.isfinite(tensor).all()):
                raise NonFiniteError(
                    f"{name} ({type(module).__name__}) produced non-finite values (NaN or inf): check that module's "
                    "weights and its inputs (learning rate, loss scale, a bad checkpoint)")
        return check

    try:
        handles.append(call.model.get_input_embeddings().register_forward_hook(hook("the input embedding")))
        for i, layer in enumerate(call.parts.layers):
            handles.append(layer.register_forward_hook(hook(f"decoder layer {i}")))
        yield
    finally:
        for handle in handles:
            handle.remove()


class FiniteChecks(DecoderFeature):
    """``check_finite=True``: the per-layer hooks for the call, and the final output's test after it."""

    name = "finite_checks"

    def active(self, call: DecoderCall) -> bool:
        return call.check_finite

    def enter(self, call: DecoderCall) -> Any:
        return finite_checks(call)

    def check(self, call: DecoderCall) -> None:
        ran, layers = call.ran(FINITE_KEY), len(call.parts.layers)
        if ran < layers:
            raise FiniteCheckNotRunError(
                f"check_finite=True: the finite checks ran {ran} times for {layers} decoder layers: the installed "
                "transformers calls the layers without their forward hooks; nothing was checked")
        if not bool(torch.isfinite(call.hidden).all()):
            raise NonFiniteError("the decoder's final norm produced non-finite values (NaN or inf)")
