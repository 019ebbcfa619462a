"""Linear-attention kernels over packed variable-length sequences (a Gated DeltaNet layer's two recurrences).

- ``packed``: the entry points, ``causal_conv1d_packed`` and ``gated_delta_rule_packed``, restarting at every
  sequence boundary (torch reference; flash-linear-attention on CUDA when installed, imported lazily).
- ``delta_rule_chunks``: the chunked gated delta rule in torch that the torch backend runs (a lean training path
  with a hand-written backward), and the first whole-pack path the tests compare it with.
"""
