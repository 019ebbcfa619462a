"""Moved to ``actorcore.mcore.build.config``; this path is kept for one release (importing it warns)."""

from actorcore._moved import alias

alias(__name__, "actorcore.mcore.build.config")
