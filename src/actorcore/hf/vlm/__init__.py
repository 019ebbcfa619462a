"""Vision-language models on the HF route: packing their inputs (``packing``: M-RoPE positions, pixels, grids and
placeholders checked against the spec's ``VisionSpec``) and the decoder's inputs per call (``inputs``: the vision
tower once per batch, its features merged into the embeddings, then cut to this rank's shard)."""
