"""Moving weights between an HF checkpoint and a sharded Megatron model, both ways: the pure layout transforms
(``transforms``, ``weight_layout``), reading HF safetensors (``safetensors_reader``) into the model (``load``),
streaming the model back as HF-named buckets (``weight_stream``), Megatron's distributed checkpoints
(``dist_checkpoint``, read without running code: ``safe_load``) and the named points where a conversion can be
paused or failed in tests (``fault_points``)."""
