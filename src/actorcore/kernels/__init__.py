"""Kernel layer: model-agnostic compute (e.g. the fused log-prob/entropy head in ``logprob/``).

Nothing heavy is imported here; import the submodule you need, e.g.
``from actorcore.kernels.logprob import linear_logprob_entropy``. Kernels import only torch
(and triton lazily, when a triton backend is chosen); they never import model code.
"""
