"""Long context on one GPU, or on several with Ulysses SP: one sequence, forward+backward of the log-prob loss, with
and without activation offload.

A Llama-8B-shaped model (hidden 4096, MLP 14336, 32 heads / 8 kv heads, vocabulary 128256), randomly initialised,
bf16 parameters, gradient checkpointing (non-reentrant) on every layer. Variants:

- ``actorcore``: ``ac.compute_loss`` (packed attention, loss-fused head), tiled MLP (``--shards``);
- ``offload``: the same with ``patch_model(..., offload_activations=...)``: all layers (``--offload-layers all``),
  the first K (an int), or ``auto``: as many leading layers as fit in 85% of the host's available memory (shared
  by the ranks of the host);
- ``transformers``: the plain model (SDPA), its logits, ``log_softmax`` in fp32, the summed log-prob as the loss.

``--sp N`` (launched with ``torchrun --nproc-per-node N``): Ulysses sequence parallelism over the N processes
(NCCL on CUDA, gloo on the CPU), ``patch_model(parallel=ctx)`` with tiled MLP (and offload); the loss is the summed
log-prob of ``ac.compute_logprobs(..., parallel=ctx)`` (``compute_loss`` does not run under SP). Each rank keeps
its 1/N of the tokens' checkpointed inputs; peak memory is reported per rank (the table shows the largest) and
rank 0 writes the results. An out-of-memory on one rank can leave the others waiting in a collective: the process
group's ``--timeout`` ends them.

``--layers N`` builds only N decoder layers so one run stays short; the JSON and the table say how many were used
and add estimates for the full 32 layers, labelled as such: time x 32/N (an upper bound: the embedding and head
are counted 32/N times), peak + (32 - N) x the per-layer parameters and gradients + the checkpointed inputs
(T/SP x 4096 x 2 bytes each) of the missing layers that would not be offloaded. ``--offload-layers`` counts layers
of the 32-layer model, whose first ones the layers built stand for (K >= N: every built layer offloads). Each cell
catches out-of-memory; an offload cell whose pinned host memory (all ranks on the host) would not fit in the
machine's available memory is skipped with the numbers. ``--memory-history`` records ``torch.cuda.memory``
history during the first step of the offload variant (else actorcore, else transformers) at the longest length and
summarises what is live at the peak, by size and allocation site. Results go to ``--out``.json and ``--out``.md
(rank 0), rewritten after every cell.

``--attention-window W``: the same shape built as a ``MistralConfig`` with ``sliding_window=W`` (every other field
Llama's; the script refuses a config that differs elsewhere), so attention is windowed to W tokens. Flash/varlen
attention keeps per token the same tensors whatever the window (output and log-sum-exp; its backward's working set
is per token too), so the memory is that of full causal attention while the time is not: at 512K tokens the linear
layers dominate and a 32-layer step fits in one command. The results say so (``attention_window`` in the setup and
every cell, an ``attention`` column, a bold label). Before the runs, every rank proves on the CPU that the window
reaches actorcore's attention kernel, exactly (``check_window``: the model's own forward, full attention on the same
weights, the kernel's arguments), and each cell records the ``sliding_window`` every kernel call received.

``--attention-backends auto,fa4``: each actorcore variant (``actorcore``, ``offload``) runs once per attention backend
(``patch_model(attention_backend=...)``; ``fa4``: FlashAttention-4), one after the other in this process: before and
after side by side. Each cell records its backend and the kernels' trace (``varlen_attention:<backend>`` calls).

``--memory-phases``: the first timed step of the offload variant (else actorcore, else transformers) at the longest
length, on rank 0, split into phases by module pre-/post-hooks (embedding, each decoder layer and its submodules,
final norm, lm head) and, in backward, tensor hooks on the first forward's outputs (a module's backward starts when
its output's gradient is ready) and the submodules' pre-hooks again (gradient checkpointing's recompute, told apart
from the first forward by a flag set just before ``.backward()``). Each phase has ``memory_allocated`` at its start
and end and ``max_memory_allocated`` within it (reset per phase; the running maximum keeps the step's peak, so the
reported peak is unchanged). No allocator history (``--memory-history`` crashed at 512K inside the tiled MLP's
autograd function). The JSON lists every phase; the table, the top 10 by peak. Off CUDA the numbers are null (the
hooks still run: ``--tiny`` checks that every layer's forward, recompute and backward were marked). The hooks are
removed after the step.

    PYTHONPATH=src python3 bench/long_context.py --lengths 131072,262144 --layers 4 --out /tmp/long_context
    PYTHONPATH=src python3 bench/long_context.py --tiny --out /tmp/long_context_tiny     # CPU, checks the script
    PYTHONPATH=src torchrun --nproc-per-node 2 bench/long_context.py --sp 2 --lengths 1048576 --layers 1 \
        --variants offload --offload-layers auto --warmup 0 --out /tmp/long_context_sp2
    PYTHONPATH=src torchrun --nproc-per-node 2 bench/long_context.py --sp 2 --tiny --out /tmp/lc_sp2_tiny   # gloo
    PYTHONPATH=src:/tmp/site python3 bench/long_context.py --lengths 262144 --variants actorcore --layers 4 \
        --attention-backends auto,fa4 --out /tmp/lc_fa4       # FA2 against FA4 on the 8B shape
    PYTHONPATH=src python3 bench/long_context.py --lengths 524288 --variants offload --attention-window 4096 \
        --memory-phases --warmup 1 --out /tmp/lc512k_32l      # 32 layers; all offloaded: 128 GiB pinned host memory
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import tempfile
import time
from collections import Counter, defaultdict

import torch

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=False,
                max_position_embeddings=1 << 21)
TINY = dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=8192)
FULL_LAYERS = 32
VARIANTS = ("transformers", "actorcore", "offload")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _enable_checkpointing(model) -> None:
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.24
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _neg_logprob(logprob, entropy):
    return -logprob


def _actorcore_step(model, ids, parallel=None, before_backward=lambda: None):
    import actorcore as ac

    trace = Counter()
    if parallel is None:
        out = ac.compute_loss(model, ac.pack([ids]), _neg_logprob, entropy=False, trace=trace)
        before_backward()
        out.loss.backward()
    else:  # compute_loss does not run under SP: the summed log-prob of the gathered [T] outputs
        out = ac.compute_logprobs(model, ac.pack([ids]), entropy=False, parallel=parallel, trace=trace)
        loss = -out.log_probs.sum()
        before_backward()
        loss.backward()
    return trace


def _transformers_step(model, ids, parallel=None, before_backward=lambda: None):
    logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1]
    logprob = torch.log_softmax(logits.float(), -1).gather(-1, ids[1:, None])
    loss = -logprob.sum()
    before_backward()
    loss.backward()
    return Counter()


def _host_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def summarize_memory_history(snapshot: dict, top: int = 15) -> dict:
    """Replay the recorded allocations; what is live at the peak, grouped by size and allocation site."""
    live: dict[int, tuple[int, str]] = {}
    current = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for device_trace in snapshot.get("device_traces", []):
        for event in device_trace:
            action, addr, size = event.get("action"), event.get("addr"), int(event.get("size", 0))
            if action == "alloc":
                live[addr] = (size, _site(event.get("frames", [])))
                current += size
                if current > peak:
                    peak, at_peak = current, dict(live)
            elif action in ("free_requested", "free") and addr in live:
                current -= live.pop(addr)[0]
    groups: dict[tuple[int, str], list[int]] = defaultdict(lambda: [0, 0])
    for size, site in at_peak.values():
        groups[(size, site)][0] += 1
        groups[(size, site)][1] += size
    rows = sorted(({"size_mib": size / 2**20, "count": n, "total_gib": total / 2**30, "site": site}
                   for (size, site), (n, total) in groups.items()), key=lambda r: -r["total_gib"])
    return {"peak_during_recording_gib": peak / 2**30, "live_at_peak": rows[:top],
            "other_gib": sum(r["total_gib"] for r in rows[top:])}


def _site(frames: list) -> str:
    """The first frame in actorcore or transformers code (else the first Python frame): who allocated."""
    python = [f for f in frames if str(f.get("filename", "")).endswith(".py")]
    for f in python:
        name = str(f.get("filename", ""))
        if "/actorcore/" in name or "/transformers/" in name:
            return f"{name.split('/site-packages/')[-1].split('/src/')[-1]}:{f.get('line')} {f.get('name')}"
    if python:
        f = python[0]
        return f"{str(f.get('filename')).split('/site-packages/')[-1]}:{f.get('line')} {f.get('name')}"
    return "(no Python frame)"


# Fields in which the windowed (Mistral) config may differ from the Llama one: the window itself, and Llama's
# bias switches and tensor-parallel split count (Mistral has no biases and no such split: the same computation).
_WINDOW_CONFIG_DIFFERENCES = {"model_type", "sliding_window", "attention_bias", "mlp_bias", "pretraining_tp",
                              "architectures", "transformers_version"}


def build_config(shape: dict, window: int | None):
    """The Llama config of ``shape``, or with ``window`` the same shape as a ``MistralConfig`` whose attention is
    windowed to ``window`` tokens (Mistral's attention hands ``config.sliding_window`` to the attention function;
    every other field that shapes the computation is Llama's)."""
    from transformers import AutoConfig

    llama = AutoConfig.for_model("llama", **shape)
    if window is None:
        return llama
    if window < 1:
        raise SystemExit(f"--attention-window must be a positive number of tokens, got {window}")
    mistral = AutoConfig.for_model("mistral", **shape, sliding_window=window)
    a, b = llama.to_dict(), mistral.to_dict()
    if differ := sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k) and k not in _WINDOW_CONFIG_DIFFERENCES):
        raise SystemExit(f"the windowed (Mistral) config differs from the Llama one in {differ}: "
                         f"{[(k, a.get(k), b.get(k)) for k in differ]}")
    return mistral


@contextlib.contextmanager
def attention_windows_seen():
    """Count the ``sliding_window`` each call of actorcore's packed attention kernel receives (plain and Ulysses
    attention both call it through ``actorcore.hf.features.attention``): proof that the window reaches the kernel."""
    import actorcore.hf.features.attention as attention

    seen: Counter = Counter()
    kernel = attention.varlen_causal_attention

    def counting(*args, **kwargs):
        seen[str(kwargs.get("sliding_window"))] += 1
        return kernel(*args, **kwargs)

    attention.varlen_causal_attention = counting
    try:
        yield seen
    finally:
        attention.varlen_causal_attention = kernel


def check_window(window: int) -> dict:
    """Prove on the CPU (fp32, the tiny shape) that a windowed model's attention is windowed, exactly at ``window``.

    On one sequence of ``window + max(128, window // 4)`` tokens: (1) ``actorcore.verify``: actorcore's packed
    route gives per token what the model's own transformers forward gives (which applies the window with its own
    sliding-window mask); the same weights with full causal attention (the Llama model) give (2) the same log-probs
    for tokens 1..window (predicted from positions < window, which see every earlier key either way) and (3)
    different ones after; (4) the kernel received ``sliding_window=window`` in every call. A window that did not
    reach the kernel, or sat one token off, fails (1) and (2) or (3). Seconds (10 s at a window of 4096).
    """
    import actorcore as ac
    from actorcore.hf.verify import VERIFY_TOLERANCE
    from transformers import AutoModelForCausalLM

    tokens = window + max(128, window // 4)
    shape = dict(TINY, max_position_embeddings=max(TINY["max_position_embeddings"], tokens))
    torch.manual_seed(2)
    windowed = AutoModelForCausalLM.from_config(build_config(shape, window), attn_implementation="sdpa",
                                                dtype=torch.float32)
    full = AutoModelForCausalLM.from_config(build_config(shape, None), attn_implementation="sdpa",
                                            dtype=torch.float32)
    full.load_state_dict(windowed.state_dict(), strict=True)
    ids = torch.randint(0, shape["vocab_size"], (tokens,), generator=torch.Generator().manual_seed(3))
    batch = ac.pack([ids])
    tolerance = VERIFY_TOLERANCE[torch.float32]
    with attention_windows_seen() as seen:
        report = ac.verify(windowed, batch)
        with torch.no_grad():
            lp_windowed = ac.compute_logprobs(windowed, batch, entropy=False).log_probs
    with torch.no_grad():
        lp_full = ac.compute_logprobs(full, batch, entropy=False).log_probs
    diff = (lp_windowed - lp_full).abs()
    inside, beyond = float(diff[1:window + 1].max()), float(diff[window + 1:].max())
    result = {"window": window, "tokens": tokens, "verify_max_abs_diff": report.max_abs_diff_logprob,
              "windowed_vs_full_max_abs_diff_within_window": inside,
              "windowed_vs_full_max_abs_diff_beyond_window": beyond, "tolerance": tolerance,
              "kernel_windows_seen": dict(seen)}
    problems = []
    if not report.ok:
        problems.append(f"actorcore differs from the windowed model's own forward ({report.summary()})")
    if inside > tolerance:
        problems.append(f"tokens 1..{window} differ from full attention by {inside:.2e} (> {tolerance:.0e})")
    if beyond <= 100 * tolerance:
        problems.append(f"tokens after {window} differ from full attention by only {beyond:.2e}: no window applied")
    if set(seen) != {str(window)}:
        problems.append(f"the attention kernel received sliding_window {dict(seen)}, not only {window}")
    if problems:
        raise SystemExit("--attention-window check failed: " + "; ".join(problems) + f" ({result})")
    return result


class PhaseRecorder:
    """GPU memory per phase of one step, from hooks (no allocator history: that recorder crashed at 512K).

    ``mark(name)`` ends the running phase and starts ``name``: each phase gets ``memory_allocated`` at its start
    and end and ``max_memory_allocated`` within it (the peak statistic is reset at every mark). ``global_peak``
    keeps the largest of those, so the step's peak is still known. Off CUDA the numbers are None.
    """

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.phases: list[dict] = []
        self.global_peak = 0
        self.in_backward = False

    def mark(self, name: str) -> None:
        if self.phases and self.phases[-1]["name"] == name:
            return  # a module called twice in a row (e.g. the same norm): one phase
        now = torch.cuda.memory_allocated() if self.cuda else None
        self._close(now)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.phases.append({"name": name, "start_gib": None if now is None else now / 2**30,
                            "end_gib": None, "peak_gib": None})

    def finish(self) -> None:
        self._close(torch.cuda.memory_allocated() if self.cuda else None)

    def _close(self, now: int | None) -> None:
        if not self.phases or self.phases[-1]["end_gib"] is not None or now is None:
            return
        peak = torch.cuda.max_memory_allocated()
        self.global_peak = max(self.global_peak, peak)
        self.phases[-1].update(end_gib=now / 2**30, peak_gib=peak / 2**30)


def attach_phase_hooks(model, recorder: PhaseRecorder) -> list:
    """Hooks that mark the phases of one forward+backward; returns the handles (remove them after the step).

    Forward: module pre-hooks mark the embedding, each decoder layer's start (the checkpoint saves or offloads its
    input there) and each of its submodules (``input_layernorm``, ``self_attn``, ...), the final norm and the lm
    head; after the final norm the phase runs until backward (the loss-fused head does not call ``lm_head``).
    Backward (``recorder.in_backward``, set by the step just before ``.backward()``): tensor hooks registered on
    the first forward's outputs mark when a module's backward begins (its output's gradient is ready); the
    submodules' pre-hooks fire again when gradient checkpointing recomputes the layer, marked ``recompute``.
    Checkpointing stops recomputing after the last tensor the backward needs (early stop), so a layer's last
    ``recompute`` phase runs on into that submodule's backward (with the tiled MLP: the MLP's).
    """
    handles: list = []
    decoder = model.model

    def forward_mark(name: str):
        def pre(module, args):
            if not recorder.in_backward:
                recorder.mark(f"fwd {name}")
        return pre

    def grad_mark_after(name: str, recompute_name: str | None = None):
        def post(module, args, output):
            if recorder.in_backward:
                return
            tensor = output if isinstance(output, torch.Tensor) else next(
                (t for t in (output if isinstance(output, (tuple, list)) else ()) if isinstance(t, torch.Tensor)),
                None)
            if tensor is not None and tensor.requires_grad:
                handles.append(tensor.register_hook(lambda grad: recorder.mark(f"bwd {name}")))
            if recompute_name:
                recorder.mark(recompute_name)
        return post

    def recompute_mark(name: str):
        def pre(module, args):
            if recorder.in_backward:
                recorder.mark(f"bwd {name} recompute")
        return pre

    handles.append(decoder.embed_tokens.register_forward_pre_hook(forward_mark("embedding")))
    handles.append(decoder.embed_tokens.register_forward_hook(grad_mark_after("embedding", "fwd rotary, masks")))
    for i, layer in enumerate(decoder.layers):
        handles.append(layer.register_forward_pre_hook(forward_mark(f"L{i} start (checkpoint input)")))
        for child_name, child in layer.named_children():
            name = f"L{i} {child_name}"
            handles.append(child.register_forward_pre_hook(forward_mark(name)))
            handles.append(child.register_forward_pre_hook(recompute_mark(name)))
            handles.append(child.register_forward_hook(grad_mark_after(name)))
    handles.append(decoder.norm.register_forward_pre_hook(forward_mark("final norm")))
    handles.append(decoder.norm.register_forward_hook(grad_mark_after("final norm", "fwd head + loss")))
    handles.append(model.lm_head.register_forward_pre_hook(forward_mark("lm_head")))
    handles.append(model.lm_head.register_forward_hook(grad_mark_after("lm_head", "fwd loss")))
    return handles


def summarize_phases(phases: list[dict], top: int = 10) -> dict:
    """The phase where the step's peak happened and the ``top`` phases by peak (None numbers: not measured)."""
    measured = [p for p in phases if p.get("peak_gib") is not None]
    if not measured:
        return {"peak_phase": None, "peak_gib": None, "top": []}
    ranked = sorted(measured, key=lambda p: -p["peak_gib"])
    return {"peak_phase": ranked[0]["name"], "peak_gib": ranked[0]["peak_gib"], "top": ranked[:top]}


def _profiled_step(step, model, ids, parallel, recorder: PhaseRecorder, windows):
    """One step with the phase hooks attached (removed afterwards, also on an error)."""
    handles = attach_phase_hooks(model, recorder)

    def before_backward() -> None:
        recorder.in_backward = True
        recorder.mark("bwd head + loss")

    try:
        recorder.mark("step start")
        with windows() as seen:
            trace = step(model, ids, parallel, before_backward=before_backward)
    finally:
        for handle in handles:
            handle.remove()
    return trace, seen


def _phase_results(recorder: PhaseRecorder, variant: str, tokens: int, layers: int) -> dict:
    names = [p["name"] for p in recorder.phases]
    return dict(summarize_phases(recorder.phases), variant=variant, tokens=tokens,
                missing=_check_phase_structure(names, layers),
                step_peak_gib=recorder.global_peak / 2**30 if recorder.cuda else None, phases=recorder.phases)


def _check_phase_structure(names: list[str], layers: int) -> list[str]:
    """What the hooks should have marked and did not (empty: every layer's forward, recompute and backward)."""
    wanted = ["fwd embedding", "fwd final norm", "bwd head + loss", "bwd final norm", "bwd embedding"]
    for i in range(layers):
        wanted += [f"fwd L{i} start (checkpoint input)", f"fwd L{i} self_attn", f"fwd L{i} mlp",
                   f"bwd L{i} self_attn recompute", f"bwd L{i} mlp recompute", f"bwd L{i} self_attn"]
    missing = [n for n in wanted if n not in names]
    first_backward = names.index("bwd head + loss") if "bwd head + loss" in names else len(names)
    if any(n.startswith("bwd") for n in names[:first_backward]) or any(
            n.startswith("fwd") for n in names[first_backward:]):
        missing.append("(forward and backward phases interleave: the backward flag is wrong)")
    return missing


def _self_test_summary() -> None:
    """``summarize_phases`` on synthetic numbers (run by ``--tiny``)."""
    phases = [{"name": f"p{i}", "start_gib": 1.0, "end_gib": 1.0, "peak_gib": float(v)}
              for i, v in enumerate([3, 9, 1, 7, 9.5, 2, 8, 4, 6, 5, 0.5, 2.5])]
    summary = summarize_phases(phases, top=3)
    assert summary["peak_phase"] == "p4" and summary["peak_gib"] == 9.5, summary
    assert [p["name"] for p in summary["top"]] == ["p4", "p1", "p6"], summary
    assert summarize_phases([{"name": "x", "start_gib": None, "end_gib": None, "peak_gib": None}]) == {
        "peak_phase": None, "peak_gib": None, "top": []}


def _write(results: dict, out: str) -> None:
    """Atomic writes of ``out``.json and ``out``.md."""
    directory = os.path.dirname(os.path.abspath(out))
    os.makedirs(directory, exist_ok=True)
    for suffix, text in ((".json", json.dumps(results, indent=1)), (".md", _markdown(results))):
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".long_context")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, out + suffix)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _markdown(results: dict) -> str:
    setup = results["setup"]
    sp = setup.get("sp", 1)
    lines = [f"# Long context: {setup['model']}, {setup['layers']} of {FULL_LAYERS} layers built, "
             f"{setup['device']}" + (f", Ulysses SP={sp} on {sp} processes" if sp > 1 else ""), "",
             f"One sequence, forward+backward of the log-prob loss, bf16 parameters, gradient checkpointing; tiled "
             f"MLP {setup['shards']} shards"
             + (" and recomputed norms (`recompute_norms=True`)" if setup.get("recompute_norms") else "")
             + f" for actorcore. Warm-up steps {setup['warmup']}, timed {setup['repeats']} "
             "(median). `32L` columns are estimates from the layers built (time x 32/N, an upper bound; peak + the "
             "missing layers' parameters, gradients and, for the layers not offloaded, checkpointed inputs)."
             + (" Peak memory: the largest over the ranks (the JSON has each rank's)." if sp > 1 else ""), ""]
    window = setup.get("attention_window")
    if window is not None:
        check = results.get("window_check", {})
        lines += [f"**Attention windowed to {window} tokens: memory as full causal, time not.** The model is the "
                  f"same shape as a `MistralConfig` with `sliding_window={window}`; flash/varlen attention keeps "
                  "per token the same tensors whatever the window, so the peaks stand for full causal attention, "
                  "while the seconds, tokens/s and 32L time estimates are those of windowed attention (cheaper "
                  "than full causal at these lengths). The plain transformers variant applies the window with a "
                  "`[T, T]` mask: its memory is not that of full causal attention."
                  + (f" Window check (CPU, tiny shape, {check['tokens']} tokens): actorcore vs the model's own "
                     f"forward {check['verify_max_abs_diff']:.1e}; vs full attention on the same weights "
                     f"{check['windowed_vs_full_max_abs_diff_within_window']:.1e} for tokens 1..{window}, "
                     f"{check['windowed_vs_full_max_abs_diff_beyond_window']:.1e} after; the kernel received "
                     f"`sliding_window` {check['kernel_windows_seen']}." if check else ""), ""]
    seconds = "seconds" if window is None else f"seconds (window {window})"
    lines += [f"| variant | tokens | attention | offloaded layers (built, 32L) | {seconds} | tokens/s | peak GiB | "
              "est. 32L seconds | est. 32L peak GiB | host GiB offloaded (32L, all ranks) | note |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in results["cells"]:
        offloaded = f"{c['offload_layers']}, {c['offload_layers_full']}" if "offload_layers" in c else "-"
        attention = "full causal" if c.get("attention_window") is None else f"window {c['attention_window']}"
        attention += f", {c['attention_backend']}" if c.get("attention_backend") else ""
        lines.append(f"| {c['variant']} | {c['tokens']} | {attention} | {offloaded} | "
                     f"{_fmt(c.get('seconds'), '.2f')} | "
                     f"{_fmt(c.get('tokens_per_s'), '.0f')} | {_fmt(c.get('peak_gib'), '.1f')} | "
                     f"{_fmt(c.get('est_full_seconds'), '.1f')} | {_fmt(c.get('est_full_peak_gib'), '.1f')} | "
                     f"{_fmt(c.get('offload_host_gib_full'), '.0f')} | {c.get('status', '')} |")
    history = results.get("memory_history")
    if history:
        lines += ["", f"## Live at the peak: {history['variant']} at {history['tokens']} tokens "
                  f"({history['peak_during_recording_gib']:.1f} GiB allocated during the step, "
                  f"{history['allocated_before_gib']:.1f} GiB before it: parameters, gradients, inputs)", "",
                  "| size MiB | count | total GiB | allocated at |", "|---|---|---|---|"]
        for r in history["live_at_peak"]:
            lines.append(f"| {r['size_mib']:.1f} | {r['count']} | {r['total_gib']:.2f} | `{r['site']}` |")
        lines.append(f"| | | {history['other_gib']:.2f} | (everything else) |")
    lines += _phases_markdown(results.get("memory_phases"))
    return "\n".join(lines) + "\n"


def _phases_markdown(phases: dict | None) -> list[str]:
    if not phases:
        return []
    head = (f"## Memory by phase: {phases['variant']} at {phases['tokens']} tokens, first timed step "
            f"({len(phases['phases'])} phases" + (f"; {phases['status']}" if phases.get("status") else "") + ")")
    if phases["peak_phase"] is None:
        return ["", head, "", "Not measured off CUDA (the phase list is in the JSON, with null numbers)."]
    lines = ["", head, "", f"Peak {phases['peak_gib']:.1f} GiB in `{phases['peak_phase']}`. `bwd X` starts when X's "
             "output gradient is ready; `bwd X recompute` when checkpointing recomputes X (the layer's last "
             "recompute phase runs on into that module's backward: the recompute stops early)."
             + (f" Not marked: {phases['missing']}." if phases["missing"] else ""), "",
             "| phase | start GiB | end GiB | peak GiB |", "|---|---|---|---|"]
    for p in phases["top"]:
        lines.append(f"| {p['name']} | {p['start_gib']:.2f} | {p['end_gib']:.2f} | {p['peak_gib']:.2f} |")
    return lines


def _offload_count(spec: str) -> int | None:
    """``--offload-layers``: of the full 32-layer model, all, the first K, or auto (None: decided per length)."""
    if spec in ("all", "auto"):
        return FULL_LAYERS if spec == "all" else None
    count = int(spec)
    if not 1 <= count <= FULL_LAYERS:
        raise SystemExit(f"--offload-layers {count} must be between 1 and {FULL_LAYERS} (or all, auto)")
    return count


def _distributed(args):
    """(rank, world size, ParallelContext or None, device) for ``--sp``; initialises the process group."""
    if args.sp == 1:
        return 0, 1, None, "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    import torch.distributed as dist

    import actorcore as ac

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.sp:
        raise SystemExit(f"--sp {args.sp} needs {args.sp} processes: launch with torchrun --nproc-per-node {args.sp}"
                         f" (WORLD_SIZE is {world})")
    cuda = torch.cuda.is_available() and not args.tiny
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout))
    ctx = ac.ParallelContext(sp_group=dist.new_group(list(range(world))))
    return dist.get_rank(), world, ctx, "cuda" if cuda else "cpu"


def _agree(value, world: int):
    """Rank 0's value on every rank (decisions that read the host's memory must match across ranks)."""
    if world == 1:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(value, world: int) -> list:
    if world == 1:
        return [value]
    import torch.distributed as dist

    out = [None] * world
    dist.all_gather_object(out, value)
    return out


def main() -> None:
    import actorcore as ac
    from actorcore.hf.features.offload import host_bytes
    from transformers import AutoModelForCausalLM

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="131072,262144,524288", help="comma-separated sequence lengths")
    parser.add_argument("--transformers-lengths", default="32768,65536",
                        help="lengths at which the plain transformers variant runs")
    parser.add_argument("--variants", default=None, help=f"comma-separated, from {VARIANTS} (default: all; with "
                        "--sp > 1 actorcore,offload)")
    parser.add_argument("--layers", type=int, default=None, help=f"decoder layers to build (default {FULL_LAYERS})")
    parser.add_argument("--shards", type=int, default=8, help="tiled-MLP shards")
    parser.add_argument("--recompute-norms", action="store_true",
                        help="actorcore variants: patch_model(recompute_norms=True), the norms keep only their input")
    parser.add_argument("--offload-layers", default="all", help="offload variant: all, auto, or K: the first K of "
                        f"the {FULL_LAYERS}-layer model (the layers built are its first ones)")
    parser.add_argument("--sp", type=int, default=1, help="Ulysses SP size (launch with torchrun)")
    parser.add_argument("--fused-decoder", action="store_true", help="patch_model(compiled_decoder=True): the compiled "
                        "layers also with SP, tiled MLP and offload (the default 'auto' keeps those eager)")
    parser.add_argument("--timeout", type=int, default=150, help="--sp: process-group timeout in seconds")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--memory-history", action="store_true")
    parser.add_argument("--memory-phases", action="store_true", help="per-phase GPU memory of the first timed step "
                        "of the offload variant (else actorcore, else transformers) at the longest length, from "
                        "module and tensor hooks")
    parser.add_argument("--attention-window", type=int, default=None, metavar="W", help="build the same shape as "
                        "a MistralConfig with sliding_window=W: attention windowed to W tokens (memory as full "
                        "causal, time not)")
    parser.add_argument("--attention-backends", default="auto", help="comma-separated patch_model(attention_backend=)"
                        " values; each actorcore variant runs once per backend (e.g. auto,fa4)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (checks the script)")
    parser.add_argument("--out", required=True, help="path prefix of the .json and .md results")
    args = parser.parse_args()

    rank, world, parallel, device = _distributed(args)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    plain_lengths = {int(x) for x in args.transformers_lengths.split(",") if x}
    default_variants = VARIANTS if args.sp == 1 else ("actorcore", "offload")
    variants = [v for v in (args.variants.split(",") if args.variants else default_variants) if v]
    if unknown := set(variants) - set(VARIANTS):
        raise SystemExit(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    attention_backends = [b for b in args.attention_backends.split(",") if b]
    if args.sp > 1 and "transformers" in variants:
        raise SystemExit("the plain transformers variant does not run under --sp (it cannot split the sequence)")
    if args.tiny:
        lengths, plain_lengths = [256, 512], {256}
    if args.layers is None:
        args.layers = TINY["num_hidden_layers"] if args.tiny else FULL_LAYERS
    offload_count = _offload_count(args.offload_layers)
    shape = dict(TINY if args.tiny else LLAMA_8B, num_hidden_layers=args.layers)
    window = args.attention_window
    config = build_config(shape, window)
    # Every rank proves the window reaches the kernel (CPU, the tiny shape; seconds) before the long runs.
    window_check = check_window(window) if window is not None else None
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    _enable_checkpointing(model)
    model.train()
    hidden = config.hidden_size
    layer_params = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))  # ranks sharing this host's memory
    model_name = "tiny llama" if args.tiny else "Llama-8B shape"
    if window is not None:
        model_name += f" as Mistral, attention windowed to {window} tokens"
    results = {"setup": {"model": model_name, "layers": args.layers, "attention_window": window,
                         "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                         "sp": args.sp, "shards": args.shards, "recompute_norms": args.recompute_norms, "compiled_decoder": args.compiled_decoder, "warmup": args.warmup, "repeats": args.repeats,
                         "offload_layers": args.offload_layers, "torch": torch.__version__,
                         "attention_backends": attention_backends,
                         "host_available_gib": (_host_available_bytes() or 0) / 2**30},
               "cells": []}
    if window_check is not None:
        results["window_check"] = window_check
    if args.tiny:
        _self_test_summary()
    write = (lambda: _write(results, args.out)) if rank == 0 else (lambda: None)
    g = torch.Generator().manual_seed(1)
    longest = max(lengths)
    history_variant = next(v for v in ("offload", "actorcore", "transformers") if v in variants)
    phases_tokens = max(plain_lengths if history_variant == "transformers" else lengths)
    for tokens in sorted(set(lengths) | (plain_lengths if "transformers" in variants else set())):
        ids = torch.randint(0, config.vocab_size, (tokens,), generator=g).to(device)
        for variant, backend in [(v, b) for v in variants
                                 for b in ((None,) if v == "transformers" else attention_backends)]:
            if tokens not in (plain_lengths if variant == "transformers" else lengths):
                continue
            cell = {"variant": variant, "tokens": tokens, "layers": args.layers, "sp": args.sp,
                    "attention_window": window, "attention_backend": backend}
            checkpoint_bytes = -(-tokens // args.sp) * hidden * 2  # one layer's checkpointed input on one rank
            offload = offload_full = 0
            if variant == "offload":
                per_layer_host = host_bytes(checkpoint_bytes) * local_world  # every rank on this host
                available = _agree(_host_available_bytes(), world)
                offload_full = offload_count
                if offload_full is None:  # auto: as many leading layers of the full model as fit
                    offload_full = (min(FULL_LAYERS, int(0.85 * available) // per_layer_host) if available
                                    else FULL_LAYERS)
                offload = min(offload_full, args.layers)
                cell.update(offload_layers=offload, offload_layers_full=offload_full,
                            offload_host_gib_full=offload_full * per_layer_host / 2**30)
                if device == "cuda" and available is not None and (offload == 0
                                                                   or offload * per_layer_host > 0.9 * available):
                    cell["status"] = (f"skipped: {max(offload, 1)} layers need "
                                      f"{max(offload, 1) * per_layer_host / 2**30:.0f} GiB pinned host memory "
                                      f"({local_world} ranks), {available / 2**30:.0f} GiB available")
                    results["cells"].append(cell)
                    write()
                    continue
            handle = None
            if variant != "transformers":
                handle = ac.patch_model(model, parallel=parallel, tiled_mlp_shards=args.shards,
                                        offload_activations=offload or False, recompute_norms=args.recompute_norms,
                                        compiled_decoder=True if args.compiled_decoder else "auto",
                                        attention_backend=backend)
                cell["attention_choice"] = handle.plan["attention"].line()
            step = _transformers_step if variant == "transformers" else _actorcore_step
            first_backend = backend in (None, attention_backends[0])
            record = (args.memory_history and device == "cuda" and rank == 0 and tokens == longest
                      and variant == history_variant and first_backend)
            profile = (args.memory_phases and rank == 0 and tokens == phases_tokens and variant == history_variant
                       and first_backend)
            oom = False
            recorder = None
            windows = attention_windows_seen if window is not None else (lambda: contextlib.nullcontext(None))
            try:
                times, peak, trace = [], 0, Counter()
                for i in range(args.warmup + args.repeats):
                    model.zero_grad(set_to_none=True)
                    gc.collect()
                    if device == "cuda":
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats()
                    recording = record and i == 0
                    if recording:
                        before = torch.cuda.memory_allocated()
                        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
                    recorder = PhaseRecorder(device == "cuda") if profile and i == args.warmup else None
                    start = time.perf_counter()
                    if recorder is None:
                        with windows() as seen:
                            trace = step(model, ids, parallel)
                    else:
                        trace, seen = _profiled_step(step, model, ids, parallel, recorder, windows)
                    _sync()
                    elapsed = time.perf_counter() - start
                    if recorder is not None:
                        recorder.finish()
                        results["memory_phases"] = _phase_results(recorder, variant, tokens, args.layers)
                        if args.tiny and results["memory_phases"]["missing"]:
                            raise SystemExit(f"--memory-phases: hooks did not mark "
                                             f"{results['memory_phases']['missing']}")
                    if seen is not None:
                        cell["attention_windows_seen"] = dict(seen)
                    if recording:
                        snapshot = torch.cuda.memory._snapshot()
                        torch.cuda.memory._record_memory_history(enabled=None)
                        results["memory_history"] = dict(
                            summarize_memory_history(snapshot), variant=variant, tokens=tokens,
                            allocated_before_gib=before / 2**30, timed=i >= args.warmup)
                        del snapshot
                    if i >= args.warmup:
                        times.append(elapsed)
                        if device == "cuda":
                            peak = max(peak, torch.cuda.max_memory_allocated(),
                                       recorder.global_peak if recorder is not None else 0)
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                if not _is_oom(exc):
                    raise
                oom = True
                if record:
                    torch.cuda.memory._record_memory_history(enabled=None)
                if recorder is not None and recorder.phases:
                    recorder.finish()
                    results["memory_phases"] = dict(_phase_results(recorder, variant, tokens, args.layers),
                                                    status="out of memory during the step: the phases so far")
                del exc
            finally:
                model.zero_grad(set_to_none=True)
                if handle is not None:
                    handle.revert()
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()
            ranks = _gather({"oom": oom, "times": times, "peak": peak}, world)
            if any(r["oom"] for r in ranks):
                cell["status"] = "out of memory" + (f" (ranks {[i for i, r in enumerate(ranks) if r['oom']]})"
                                                    if world > 1 else "")
            else:
                # A step ends when the slowest rank's does; the median over the repeats of that.
                steps = sorted(max(step_times) for step_times in zip(*(r["times"] for r in ranks)))
                seconds = steps[len(steps) // 2]
                cell.update(seconds=seconds, tokens_per_s=tokens / seconds, status="ok",
                            offload_trace={k: v for k, v in trace.items() if k.startswith("offload:")},
                            attention_trace={k: v for k, v in trace.items() if k.startswith("varlen_attention:")})
                if device == "cuda":
                    peak = max(r["peak"] for r in ranks)
                    missing = FULL_LAYERS - args.layers
                    kept_missing = (FULL_LAYERS - offload_full) - (args.layers - offload)  # inputs left on the GPU
                    extra = missing * 2 * layer_params + kept_missing * checkpoint_bytes
                    cell.update(peak_gib=peak / 2**30, est_full_peak_gib=(peak + extra) / 2**30,
                                est_full_seconds=seconds * FULL_LAYERS / args.layers)
                    if world > 1:
                        cell["peak_gib_per_rank"] = [r["peak"] / 2**30 for r in ranks]
            results["cells"].append(cell)
            write()
            if "attention_windows_seen" in cell and variant != "transformers" and set(
                    cell["attention_windows_seen"]) != {str(window)}:
                raise SystemExit(f"{variant} at {tokens} tokens: actorcore's attention kernel received sliding_window"
                                 f" {cell['attention_windows_seen']}, not only {window}")
            if rank == 0:
                print(f"{variant:>12} {backend or '':>5} {tokens:>8} tokens: {cell['status']} "
                      f"{_fmt(cell.get('seconds'), '.2f')} s "
                      f"peak {_fmt(cell.get('peak_gib'), '.1f')} GiB", flush=True)
    if rank == 0:
        print(_markdown(results))
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
