"""``actorcore demo``: packed log-probs against the plain padded Hugging Face path on an RL-like batch.

The default model is embedded: a small seeded Qwen3-shaped model and a byte-pair tokenizer trained
in-process on a few lines of text; nothing is downloaded. ``--model PATH`` uses a local HF model directory.
Returns a process exit code: non-zero when the paths disagree beyond the tolerance table.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

PROMPTS = [
    "Question: what is 17 + 25? Think step by step.",
    "Question: a train leaves at 3pm and travels 120 km at 60 km/h. When does it arrive?",
    "Question: name a prime number larger than 50.",
    "Question: is 91 prime?",
    "Question: write the word 'policy' backwards.",
    "Question: how many legs do three spiders have?",
]
RESPONSES = [
    "Answer: 17 + 25 = 42.",
    "Answer: the trip takes 120 / 60 = 2 hours, so it arrives at 5pm. Done.",
    "Answer: 53.",
    "Answer: no, 91 = 7 * 13, so it is not prime; checking divisors up to 9 finds 7 quickly.",
    "Answer: ycilop.",
    "Answer: each spider has 8 legs, three have 24. The reward model should like this one.",
]

DEMO_MODEL = dict(vocab_size=384, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                  tie_word_embeddings=False)


@dataclass
class Row:
    path: str
    max_abs_diff_logprob: float | None
    max_abs_diff_entropy: float | None
    seconds: float
    note: str = ""


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<unk>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(PROMPTS + RESPONSES, trainer=trainer)
    return lambda text: tokenizer.encode(text).ids


def _embedded_model(seed: int) -> tuple[Any, Callable[[str], list[int]]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    encode = _train_tokenizer(DEMO_MODEL["vocab_size"])
    config = AutoConfig.for_model("qwen3", **DEMO_MODEL)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return model.eval(), encode


def _local_model(path: str) -> tuple[Any, Callable[[str], list[int]] | None]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        encode = lambda text: tokenizer(text)["input_ids"]  # noqa: E731
    except (OSError, ValueError):
        logger.warning("no tokenizer in %s: using random token ids", path)
        encode = None
    return model.eval(), encode


def rl_batch(encode: Callable[[str], list[int]] | None, vocab: int, seed: int, groups: int = 4) -> list[torch.Tensor]:
    """GRPO-like batch: each prompt with several sampled-looking responses of different lengths."""
    rng = random.Random(seed)
    sequences = []
    for g in range(groups):
        prompt = PROMPTS[g % len(PROMPTS)]
        for _ in range(3):
            response = " ".join(rng.sample(RESPONSES, k=rng.randint(1, 4)))
            if encode is not None:
                ids = encode(prompt + " " + response)
            else:
                ids = [rng.randrange(vocab) for _ in range(rng.randint(8, 200))]
            sequences.append(torch.tensor(ids, dtype=torch.long) % vocab)
    return sequences


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    with torch.no_grad():
        result = fn()
    return result, time.perf_counter() - start


def run_demo(model_path: str | None = None, seed: int = 0, sp_size: int = 2, device: str | None = None) -> int:
    import actorcore as ac
    from actorcore.testing.reference import reference_logprobs, right_padded
    from actorcore.testing.tolerances import TOL

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, encode = _local_model(model_path) if model_path else _embedded_model(seed)
    model = model.to(device)
    vocab = model.get_input_embeddings().num_embeddings
    sequences = rl_batch(encode, vocab, seed)
    ids, mask = right_padded(sequences)
    batch = ac.pack_padded(ids, mask).to(device)
    ids, mask = ids.to(device), mask.to(device)

    ac.compute_logprobs(model, batch)  # warm-up, both paths
    reference_logprobs(model, ids, mask)
    packed, t_packed = _timed(lambda: ac.compute_logprobs(model, batch))
    (ref_lp, ref_ent), t_padded = _timed(lambda: reference_logprobs(model, ids, mask))

    lengths = batch.seq_lens
    padded_tokens = len(lengths) * max(lengths)
    print(f"model: {model_path or 'embedded tiny qwen3 (seeded, in-process BPE tokenizer)'}  device: {device}")
    print(f"sequences: {len(lengths)}  tokens: {batch.num_tokens}  padded tokens avoided: "
          f"{padded_tokens - batch.num_tokens} of {padded_tokens} ({1 - batch.num_tokens / padded_tokens:.0%})")
    rows = [
        Row("HF padded (plain transformers)", None, None, t_padded, "reference"),
        Row("actorcore packed + fused head", _diff(packed.log_probs, ref_lp), _diff(packed.entropy, ref_ent),
            t_packed),
    ]
    tolerance = TOL["packed_vs_hf_fp32"]
    ok = all(r.max_abs_diff_logprob is None or r.max_abs_diff_logprob <= tolerance for r in rows)
    ok &= all(r.max_abs_diff_entropy is None or r.max_abs_diff_entropy <= tolerance for r in rows)
    if model_path is None:  # SP and VLM rows run on the embedded tiny models
        extra, extra_ok = _extra_rows(sequences, sp_size, seed)
        rows += extra
        ok &= extra_ok
    _print_table(rows)
    print("OK: packed path agrees with the padded HF path per token" if ok else
          f"FAIL: a path differs by more than {tolerance:g}")
    return 0 if ok else 1


def _extra_rows(sequences: list[torch.Tensor], sp_size: int, seed: int) -> tuple[list[Row], bool]:
    """Sequence-parallel rows (gloo processes on the CPU) and the VLM row, against one process."""
    from actorcore.testing.tolerances import TOL

    rows: list[Row] = []
    if sp_size > 1:
        from actorcore.demo_sp import sp_rows

        for r in sp_rows("qwen3", [s % 131 for s in sequences], sp_size, seed):
            rows.append(Row(r["path"], r["max_abs_diff_logprob"], r["max_abs_diff_entropy"], r["seconds"],
                            f"tiny qwen3 vs 1 process; values max|Δ| {r['max_abs_diff_value']:.1e}"))
    from actorcore.demo_vlm import vlm_row

    ok = all(row.max_abs_diff_logprob <= TOL["sp_vs_single_fp32"] for row in rows)
    r = vlm_row(seed)
    rows.append(Row(r["path"], r["max_abs_diff_logprob"], r["max_abs_diff_entropy"], r["seconds"],
                    f"{r['sequences']} seqs, {r['tokens']} tokens, vs HF padded"))
    ok &= r["max_abs_diff_logprob"] <= TOL["vlm_packed_vs_hf_fp32"]
    return rows, ok


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _print_table(rows: list[Row]) -> None:
    header = f"{'path':<48} {'max|Δ| logprob':>15} {'max|Δ| entropy':>15} {'time':>10}  note"
    print(header)
    print("-" * len(header))
    for r in rows:
        lp = "-" if r.max_abs_diff_logprob is None else f"{r.max_abs_diff_logprob:.2e}"
        ent = "-" if r.max_abs_diff_entropy is None else f"{r.max_abs_diff_entropy:.2e}"
        print(f"{r.path:<48} {lp:>15} {ent:>15} {r.seconds * 1e3:>8.1f}ms  {r.note}")
