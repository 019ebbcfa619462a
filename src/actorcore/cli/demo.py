"""``actorcore demo``: packed log-probs against the plain padded Hugging Face path on an RL-like batch.

The default model is embedded (``actorcore.hf.embedded``): a small seeded Qwen3-shaped model and a byte-pair
tokenizer trained in-process on a few lines of text; nothing is downloaded. ``--model PATH`` uses a local HF
model directory. On the embedded model, sequence-parallel rows (``cli/demo_sp.py``) and a VLM row
(``cli/demo_vlm.py``) follow. Every path runs once before it is timed. Returns a process exit code: non-zero
when a path disagrees with its reference beyond ``actorcore.hf.verify.VERIFY_TOLERANCE`` (fp32).
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass
from typing import Any, Callable

import torch

from actorcore.cli.demo_sp import max_diff, timed

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
    from actorcore.hf.embedded import TEXT_MODEL, build_text_model

    return build_text_model(seed=seed), _train_tokenizer(TEXT_MODEL["vocab_size"])


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def _local_model(path: str) -> tuple[Any, Callable[[str], list[int]] | None]:
    """The model of a local directory (checked by ``check_model_dir``: nothing outside it, nothing damaged, never
    the hub) and its tokenizer; a directory without tokenizer files (``save_pretrained`` of a model alone) is
    scored on seeded random token ids, said in one log line."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actorcore.errors import CheckpointError
    from actorcore.model_files import check_model_dir

    check_model_dir(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32,
                                                     attn_implementation="sdpa")
    except Exception as exc:  # noqa: BLE001 - transformers' loading errors of a local directory are its content's
        raise CheckpointError(f"{path}: transformers could not load a causal LM from it ({type(exc).__name__}: "
                              f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''})") from exc
    encode = None
    if any(os.path.exists(os.path.join(path, name)) for name in TOKENIZER_FILES):
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            encode = lambda text: tokenizer(text)["input_ids"]  # noqa: E731
        except (OSError, ValueError) as exc:
            logger.warning("the tokenizer of %s does not load (%s): using random token ids", path, exc)
    else:
        logger.warning("no tokenizer files in %s: scoring seeded random token ids", path)
    return model.eval(), encode


def rl_batch(encode: Callable[[str], list[int]] | None, vocab: int, seed: int, groups: int = 4) -> list[torch.Tensor]:
    """GRPO-like batch: each prompt with several sampled-looking responses of different lengths."""
    rng = random.Random(seed)
    sequences = []
    for g in range(groups):
        prompt = PROMPTS[g % len(PROMPTS)]
        for _ in range(3):
            response = " ".join(rng.sample(RESPONSES, k=rng.randint(1, 4)))
            ids = encode(prompt + " " + response) if encode is not None else []
            if len(ids) < 2:  # no tokenizer, or one that gives (almost) nothing: random ids, seeded
                ids = [rng.randrange(vocab) for _ in range(rng.randint(8, 200))]
            sequences.append(torch.tensor(ids, dtype=torch.long) % vocab)
    return sequences


def run_demo(model_path: str | None = None, seed: int = 0, sp_size: int = 2, device: str | None = None) -> int:
    import actorcore as ac
    from actorcore.hf.reference import reference_logprobs, right_padded
    from actorcore.hf.verify import VERIFY_TOLERANCE

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here; use --device cpu")
    if sp_size < 0:
        raise ValueError(f"--sp must be 0 (skip the SP rows) or a positive size, got {sp_size}")
    if sp_size > 1 and model_path is None:  # before a rank is spawned: the SP rows run the embedded model
        _check_sp_size(sp_size)
    model, encode = _local_model(model_path) if model_path else _embedded_model(seed)
    model = model.to(device)
    vocab = model.get_input_embeddings().num_embeddings
    sequences = rl_batch(encode, vocab, seed)
    ids, mask = right_padded(sequences)
    batch = ac.pack_padded(ids, mask).to(device)
    ids, mask = ids.to(device), mask.to(device)

    packed, t_packed = timed(lambda: ac.compute_logprobs(model, batch))
    (ref_lp, ref_ent), t_padded = timed(lambda: reference_logprobs(model, ids, mask))

    lengths = batch.seq_lens
    padded_tokens = len(lengths) * max(lengths)
    print(f"model: {model_path or 'embedded tiny qwen3 (seeded, in-process BPE tokenizer)'}  device: {device}")
    print(f"sequences: {len(lengths)}  tokens: {batch.num_tokens}  padded tokens avoided: "
          f"{padded_tokens - batch.num_tokens} of {padded_tokens} ({1 - batch.num_tokens / padded_tokens:.0%})")
    rows = [
        Row("HF padded (plain transformers)", None, None, t_padded, "reference"),
        Row("actorcore packed + fused head", max_diff(packed.log_probs, ref_lp), max_diff(packed.entropy, ref_ent),
            t_packed, "vs HF padded"),
    ]
    tolerance = VERIFY_TOLERANCE[torch.float32]
    ok = all(r.max_abs_diff_logprob is None or r.max_abs_diff_logprob <= tolerance for r in rows)
    ok &= all(r.max_abs_diff_entropy is None or r.max_abs_diff_entropy <= tolerance for r in rows)
    if model_path is None:  # SP and VLM rows run on the embedded tiny models
        extra, extra_ok = _extra_rows(sequences, sp_size, seed, tolerance)
        rows += extra
        ok &= extra_ok
    _print_table(rows, tolerance)
    print("OK: packed path agrees with the padded HF path per token" if ok else
          f"FAIL: a path differs by more than {tolerance:g}")
    return 0 if ok else 1


def _check_sp_size(sp_size: int) -> None:
    """Refuse an ``--sp`` the embedded model's attention heads cannot be split over, naming the sizes that can."""
    from actorcore.hf.embedded import TEXT_MODEL
    from actorcore.parallel.ulysses import valid_sp_sizes

    heads, kv_heads = TEXT_MODEL["num_attention_heads"], TEXT_MODEL["num_key_value_heads"]
    valid = [s for s in valid_sp_sizes(heads, kv_heads) if s > 1]
    if sp_size not in valid:
        raise ValueError(f"--sp {sp_size}: the embedded model's {heads} attention heads ({kv_heads} key-value heads) "
                         f"cannot be split over {sp_size} ranks: use --sp {' or '.join(map(str, valid))} (0 skips "
                         "the SP rows)")


def _extra_rows(sequences: list[torch.Tensor], sp_size: int, seed: int, tolerance: float) -> tuple[list[Row], bool]:
    """Sequence-parallel rows (gloo processes on the CPU, against one process) and the VLM row (against the
    model's own forward), all on the embedded models."""
    rows: list[Row] = []
    if sp_size > 1:
        from actorcore.cli.demo_sp import sp_rows

        for r in sp_rows(sequences, sp_size, seed):
            rows.append(Row(r["path"], r["max_abs_diff_logprob"], r["max_abs_diff_entropy"], r["seconds"],
                            f"vs 1 process; critic values max|Δ| {r['max_abs_diff_value']:.1e}"))
    from actorcore.cli.demo_vlm import vlm_row

    ok = all(row.max_abs_diff_logprob <= tolerance and row.max_abs_diff_entropy <= tolerance for row in rows)
    r = vlm_row(seed)
    rows.append(Row(r["path"], r["max_abs_diff_logprob"], r["max_abs_diff_entropy"], r["seconds"],
                    f"{r['sequences']} seqs, {r['tokens']} tokens, vs HF forward per sequence"))
    ok &= r["max_abs_diff_logprob"] <= r["tolerance"] and r["max_abs_diff_entropy"] <= r["tolerance"]
    return rows, ok


def _print_table(rows: list[Row], tolerance: float) -> None:
    print(f"columns: max|Δ| logprob / entropy = largest per-token difference from the row's reference, named in "
          f"the note (OK needs <= {tolerance:g});")
    print("         time = best of 3 warm calls of the row's path (each path ran once before timing), log-probs only")
    header = f"{'path':<48} {'max|Δ| logprob':>15} {'max|Δ| entropy':>15} {'time':>10}  note"
    print(header)
    print("-" * len(header))
    for r in rows:
        lp = "-" if r.max_abs_diff_logprob is None else f"{r.max_abs_diff_logprob:.2e}"
        ent = "-" if r.max_abs_diff_entropy is None else f"{r.max_abs_diff_entropy:.2e}"
        print(f"{r.path:<48} {lp:>15} {ent:>15} {r.seconds * 1e3:>8.1f}ms  {r.note}")
