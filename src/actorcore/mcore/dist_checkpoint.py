"""Moved to ``actorcore.mcore.convert.dist_checkpoint``; this path is kept for one release (importing it warns)."""

from actorcore._moved import alias

alias(__name__, "actorcore.mcore.convert.dist_checkpoint")
