"""quack's Hopper GEMMs (``quack-kernels``, Tri Dao's CuTe-DSL kernels) with fused epilogues, in one place.

- ``runtime``: the one availability probe (``quack_refusal``: a Hopper-or-newer GPU and a quack that pins the CuTe DSL
  release installed beside it), the operand-width check (``width_refusal``) and the one entry point to quack's GEMMs
  (``gemm_interface``). Callers read them through the module (``runtime.quack_refusal()``), so a test stand-in
  replaces quack in one place.
- ``gated_mlp``: a dense SwiGLU MLP with the activation inside two of its GEMMs (``patch_model(swiglu_mlp=...)``).
- ``moe``: MoE experts' SwiGLU MLP with the token gather and the activation inside the GEMMs (HF route's
  ``moe_experts="quack"``) and the same GEMMs over rows a dispatcher sorted (the Megatron route's quack experts).

quack is optional: nothing here imports it until a GEMM runs.
"""
