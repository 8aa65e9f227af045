"""A target model with learnable structure, for serving checks of drafters: a tiny Llama trained
in-process on a synthetic chat grammar, with a word-level tokenizer.

The grammar's answers follow from the question (count on or back from a word by 1, 2 or 3,
repeat a short pattern, interleave two counts), so a trained target's greedy continuations are
predictable and a drafter trained on them is accepted often enough to measure. Words are whole
tokens (``WordLevel``), so decoding a greedy continuation and tokenizing it again gives back the
same ids: the tokens a serving engine generates are the ones a dataset stores.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

from hsstore.demo_model import SPECIAL_TOKENS, chat_tokenizer

NUM_WORDS = 200
VOCAB_SIZE = 256  # the model's embedding rows; the tokenizer uses the first 223
FUNCTION_WORDS = ["user", "assistant", "system", "count", "from", "repeat", "after", "sure",
                  "then", "by", "one", "two", "three", "back", "mix", ",", ".", "and"]  # fmt: skip
ANSWER_WORDS = 40
STAMP = "chat_grammar.json"  # what a saved target was trained with, to reuse it


def words() -> list[str]:
    return [f"w{i}" for i in range(NUM_WORDS)]


def build_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + FUNCTION_WORDS + words())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return chat_tokenizer(tok)


def conversation(rng: random.Random) -> list[dict[str, str]]:
    """One question of the grammar and its answer."""
    w = words()
    kind = rng.randrange(4)
    if kind == 0:
        a, step = rng.randrange(NUM_WORDS), rng.choice([1, 2, 3])
        question = f"count from {w[a]} by {['one', 'two', 'three'][step - 1]}"
        answer = [w[(a + step * i) % NUM_WORDS] for i in range(ANSWER_WORDS)]
    elif kind == 1:
        pattern = [w[rng.randrange(NUM_WORDS)] for _ in range(rng.randrange(2, 6))]
        question = "repeat " + " ".join(pattern)
        answer = [pattern[i % len(pattern)] for i in range(ANSWER_WORDS)]
    elif kind == 2:
        a = rng.randrange(NUM_WORDS)
        question = f"count back from {w[a]}"
        answer = [w[(a - i) % NUM_WORDS] for i in range(ANSWER_WORDS)]
    else:
        a, b = rng.randrange(NUM_WORDS), rng.randrange(NUM_WORDS)
        question = f"mix {w[a]} and {w[b]}"
        answer = [w[(a + i) % NUM_WORDS] if i % 2 == 0 else w[(b - i) % NUM_WORDS]
                  for i in range(ANSWER_WORDS)]  # fmt: skip
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": " ".join(["sure", ",", *answer])},
    ]


def train_target(
    out: str | Path,
    *,
    steps: int = 1200,
    hidden: int = 128,
    layers: int = 4,
    heads: int = 2,
    batch: int = 24,
    seed: int = 0,
    log=print,
) -> Path:
    """Train the grammar's target and save it (safetensors + tokenizer) into ``out``.

    A saved target trained with the same settings is reused. ``head_dim = hidden / heads``:
    vLLM's CPU attention needs 32 or more.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    settings = {"steps": steps, "hidden": hidden, "layers": layers, "heads": heads,
                "batch": batch, "seed": seed}  # fmt: skip
    stamp = out / STAMP
    if stamp.exists() and json.loads(stamp.read_text()) == settings:
        return out
    tok = build_tokenizer()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        head_dim=hidden // heads, max_position_embeddings=512, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, torch_dtype="float32",
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    t0 = time.perf_counter()
    for step in range(steps):
        rows = [tok.apply_chat_template(conversation(rng), tokenize=True, return_dict=False)
                for _ in range(batch)]  # fmt: skip
        width = max(len(r) for r in rows)
        ids = torch.full((batch, width), tok.pad_token_id)
        mask = torch.zeros(batch, width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        for group in opt.param_groups:  # warmup, then linear decay to 10%
            group["lr"] = 3e-3 * min(1.0, (step + 1) / 100) * (1 - 0.9 * step / steps)
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        loss.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if (step + 1) % 200 == 0 or step + 1 == steps:
            log(f"target step {step + 1}/{steps} loss {loss.loss.item():.3f} "
                f"({time.perf_counter() - t0:.0f} s)")  # fmt: skip
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    stamp.write_text(json.dumps(settings))
    return out


@torch.no_grad()
def greedy(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> list[list[int]]:
    """The target's greedy continuations of ``prompts`` (token ids), ``new_tokens`` each."""
    out = []
    for start in range(0, len(prompts), 32):
        chunk = prompts[start : start + 32]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(chunk):  # left padding: every continuation starts at `width`
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        gen = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
            pad_token_id=pad_id, eos_token_id=None,
        )  # fmt: skip
        out += [gen[r, width:].tolist() for r in range(len(chunk))]
    return out


def write_prompt_sets(
    model_dir: str | Path,
    out: str | Path,
    *,
    train: int,
    held_out: int,
    held_out_tokens: int,
    seed: int = 1,
) -> dict:
    """Prompts of the grammar answered by the target itself, greedily.

    ``train.jsonl``: ``train`` conversations whose answer is the target's greedy continuation up
    to its end-of-turn token. ``held_out.jsonl``: ``held_out`` others with the first
    ``held_out_tokens`` greedy tokens. Returns the held-out prompts as token ids and their
    greedy continuations, for an engine to generate from.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = random.Random(seed)
    questions: list[dict[str, str]] = []
    while len(questions) < train + held_out:  # each question once: no duplicate samples
        question = conversation(rng)[0]
        if question not in questions:
            questions.append(question)
    prompts = [
        tok.apply_chat_template([q], tokenize=True, add_generation_prompt=True, return_dict=False)
        for q in questions
    ]
    continuations = greedy(model, prompts, max(ANSWER_WORDS + 8, held_out_tokens), tok.pad_token_id)
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    sets = {"train": range(train), "held_out": range(train, train + held_out)}
    for name, rows in sets.items():
        with open(out / f"{name}.jsonl", "w") as f:
            for r in rows:
                answer = continuations[r]
                answer = answer[:held_out_tokens] if name == "held_out" else answer
                answer = answer[: answer.index(eot)] if eot in answer else answer
                messages = [questions[r], {"role": "assistant", "content": tok.decode(answer)}]
                f.write(json.dumps({"messages": messages}) + "\n")
    return {
        "prompts": [prompts[r] for r in sets["held_out"]],
        "greedy": [continuations[r][:held_out_tokens] for r in sets["held_out"]],
    }
