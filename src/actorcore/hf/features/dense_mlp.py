"""Renamed ``actorcore.hf.features.swiglu_mlp``; this path is kept for one release (importing it warns)."""

from actorcore._moved import alias

alias(__name__, "actorcore.hf.features.swiglu_mlp")
