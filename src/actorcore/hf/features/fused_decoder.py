"""Renamed ``actorcore.hf.features.compiled_decoder``; this path is kept for one release (importing it warns)."""

from actorcore._moved import alias

alias(__name__, "actorcore.hf.features.compiled_decoder")
