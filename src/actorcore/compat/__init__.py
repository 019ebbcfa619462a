"""Entry points shaped like other frameworks' APIs (verl), built on actorcore's own API."""
