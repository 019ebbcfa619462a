"""Test support for actorcore's users (importable without pytest): tiny seeded configs for every registered
architecture (``tiny_configs``, ``tiny_vlm``), the tolerance table (``tolerances``), a multi-process gloo runner
(``distributed``), plain-transformers references (``reference``, ``reference_vlm``), stand-ins for quack's and FA4's
Hopper kernels on the CPU (``quack_stand_in``, ``fa4_stand_in``), and the engine tier's and TRL's cases (``engines``,
``trl_cases``). What only actorcore's own test suite shares lives in ``tests/support/``."""
