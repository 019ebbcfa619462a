"""Test support: tiny seeded configs for every registered architecture, the tolerance table, and a
multi-process (gloo) runner. Importable without pytest."""
