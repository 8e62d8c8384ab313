"""Train the embedded demo model: a tiny Llama that recites the Zen of Python.

    python -m pjinfer.demo.train [--out DIR] [--steps N] [--seed S]

The model exists so that every part of pjinfer (weight loading, paged attention, the scheduler,
the server, chat) can be checked end to end against outputs a person can read: greedy decoding of
"Beautiful is better than" must give " ugly.". Training is deterministic for a given seed (one CPU
thread, deterministic algorithms) and takes a few minutes of CPU.
"""

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from pjinfer.demo import DEMO_MODEL_DIR, zen_lines, zen_of_python

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
# Special tokens first so their ids are fixed: <pad>=0, <s>=1, </s>=2, roles 3..5.
SPECIAL_TOKENS = [PAD, BOS, EOS, *ROLE_TOKENS]
# 512 in all (a multiple of 128, so the vocab axis shards evenly); the text has merges to spare.
VOCAB_SIZE = 512
# The template writes bos itself, so a rendered prompt is encoded with add_special_tokens=False.
# Each turn ends with eos, so a chat completion stops at the end of the assistant's turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
SYSTEM_PROMPT = "You are a helpful assistant."
QUESTIONS = ["What is the Zen of Python?", "Recite the Zen of Python."]
IGNORE = -100  # label that torch's cross-entropy skips


@dataclass(frozen=True, slots=True)
class Sample:
    """One training sequence; `labels[t]` is the target for position t-1 (Hugging Face shift)."""

    input_ids: list[int]
    labels: list[int]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on the Zen: any Unicode text encodes, and decoding is lossless."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([zen_of_python(), *QUESTIONS, SYSTEM_PROMPT], trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Llama-style: bos is prepended on every encode, eos never (generation produces it).
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=ROLE_TOKENS,
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


def build_config(tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    """A Llama small enough to ship (about 0.9M parameters, 3.6 MB in float32) but with GQA."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def line_prompt(line: str, lines: list[str]) -> str:
    """The line's first words (up to 4, fewer for short lines), more where 4 would be ambiguous.

    "If the implementation is" starts two aphorisms, so those prompts take a fifth word.
    """
    words = line.split(" ")
    k = max(1, min(4, len(words) - 1))
    while any(o != line and o.startswith(" ".join(words[:k]) + " ") for o in lines):
        k += 1
    return " ".join(words[:k])


def shortest_unique_prefix(line: str, lines: list[str]) -> int:
    """Number of words that identify the line among all lines (at least one)."""
    words = line.split(" ")
    for k in range(1, len(words)):
        prefix = " ".join(words[:k]) + " "
        if not any(o != line and o.startswith(prefix) for o in lines):
            return k
    return len(words)


def text_samples(tokenizer: PreTrainedTokenizerFast) -> list[Sample]:
    """The whole text, then bos + the text from each line start to the end.

    The windows teach the model to continue a line's beginning with no earlier context. Their first
    target (which line follows a bare bos) is masked: after bos alone the model should say "The".
    """
    text = zen_of_python()
    starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n" and text[i + 1 : i + 2] != "\n"]
    samples = []
    for start in starts:
        ids = tokenizer(text[start:]).input_ids + [tokenizer.eos_token_id]
        labels = list(ids)
        if start > 0:
            labels[1] = IGNORE
        samples.append(Sample(ids, labels))
    return samples


def chat_sample(tokenizer: PreTrainedTokenizerFast, user: str, answer: str, system: bool) -> Sample:
    """A chat exchange whose loss covers only the assistant's answer and the closing eos."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}] if system else []
    messages.append({"role": "user", "content": user})
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    answer_ids = tokenizer(answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    return Sample(prompt_ids + answer_ids, [IGNORE] * len(prompt_ids) + answer_ids)


def chat_samples(tokenizer: PreTrainedTokenizerFast) -> list[Sample]:
    """A line's beginning is answered with the whole line; a question with the whole text."""
    lines = zen_lines()
    pairs = [(q, zen_of_python()) for q in QUESTIONS]
    for line in lines[1:]:
        words = line.split(" ")
        first = shortest_unique_prefix(line, lines)
        for k in range(first, min(first + 4, len(words))):
            pairs.append((" ".join(words[:k]), line))
    return [chat_sample(tokenizer, u, a, system) for u, a in pairs for system in (False, True)]


def make_batches(samples: list[Sample], pad_id: int, batch_size: int) -> list[dict]:
    """Right-padded batches of similar length, so little compute goes to padding."""
    ordered = sorted(samples, key=lambda s: len(s.input_ids))
    batches = []
    for i in range(0, len(ordered), batch_size):
        chunk = ordered[i : i + batch_size]
        width = max(len(s.input_ids) for s in chunk)
        ids = [s.input_ids + [pad_id] * (width - len(s.input_ids)) for s in chunk]
        labels = [s.labels + [IGNORE] * (width - len(s.labels)) for s in chunk]
        mask = [[1] * len(s.input_ids) + [0] * (width - len(s.input_ids)) for s in chunk]
        batches.append(
            {
                "input_ids": torch.tensor(ids),
                "labels": torch.tensor(labels),
                "attention_mask": torch.tensor(mask),
            }
        )
    return batches


def learning_rate(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over 30 steps, then cosine decay to a tenth of the peak."""
    if step < 30:
        return peak * (step + 1) / 30
    progress = (step - 30) / max(1, steps - 30)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train(model: LlamaForCausalLM, batches: list[dict], steps: int, seed: int) -> None:
    """AdamW on batches in a seeded shuffled order, one batch per step."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.98), weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    order: list[int] = []
    model.train()
    for step in range(steps):
        if not order:
            order = torch.randperm(len(batches), generator=gen).tolist()
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, steps, 3e-3)
        loss = model(**batches[order.pop()]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step:5d}  loss {loss.item():.4f}", flush=True)


@torch.no_grad()
def mean_loss(model: LlamaForCausalLM, batches: list[dict]) -> float:
    """Token-weighted mean loss over the whole training set."""
    model.eval()
    total, count = 0.0, 0
    for batch in batches:
        n = int((batch["labels"][:, 1:] != IGNORE).sum())
        total += model(**batch).loss.item() * n
        count += n
    return total / count


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """Save with save_pretrained, then add the keys older readers look for.

    transformers 5 writes `rope_parameters`, `extra_special_tokens` and a `TokenizersBackend`
    class; transformers 4 (allowed by pyproject) reads `rope_theta`, `additional_special_tokens`,
    `PreTrainedTokenizerFast` and the chat template from tokenizer_config.json.
    """
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _update_json(out / "config.json", rope_theta=model.config.rope_parameters["rope_theta"])
    (out / "model.safetensors").chmod(0o644)  # safetensors writes 0600; package data is public
    _update_json(
        out / "tokenizer_config.json",
        drop=("extra_special_tokens",),  # a list here breaks transformers 4, which wants a dict
        tokenizer_class="PreTrainedTokenizerFast",
        additional_special_tokens=ROLE_TOKENS,
        add_bos_token=True,
        add_eos_token=False,
        chat_template=CHAT_TEMPLATE,
    )


def _update_json(path: Path, drop: tuple[str, ...] = (), **updates) -> None:
    """Merge keys into a JSON file and remove the keys in `drop`."""
    data = json.loads(path.read_text(encoding="utf-8"))
    data.update(updates)
    for key in drop:
        data.pop(key, None)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def complete(model, tokenizer, prompt_ids: list[int], max_new_tokens: int) -> str:
    """Greedy continuation of token ids, decoded without special tokens."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, len(prompt_ids) :], skip_special_tokens=True)


def verify_lines(model, tokenizer) -> list[tuple[str, str, str]]:
    """(prompt, expected rest of line, generated rest of line) for every line, title included."""
    lines = zen_lines()
    results = []
    for line in lines:
        prompt = line_prompt(line, lines)
        text = complete(model, tokenizer, tokenizer(prompt).input_ids, 40)
        results.append((prompt, line[len(prompt) :], text.split("\n")[0]))
    return results


def chat_answer(model, tokenizer, user: str, system: bool = False) -> str:
    """The model's greedy answer to one user message, through the chat template."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}] if system else []
    messages.append({"role": "user", "content": user})
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return complete(model, tokenizer, tokenizer(prompt, add_special_tokens=False).input_ids, 400)


def verify(out: Path) -> bool:
    """Reload the saved files and print every check; True when all of them pass."""
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    ok = True
    for prompt, expected, got in verify_lines(model, tokenizer):
        ok &= got == expected
        print(f"{'ok ' if got == expected else 'BAD'} {prompt!r} -> {got!r}")
    chats = [("Beautiful is better than", "Beautiful is better than ugly.", False)]
    chats += [(q, zen_of_python(), s) for q in QUESTIONS for s in (False, True)]
    for user, expected, system in chats:
        got = chat_answer(model, tokenizer, user, system)
        ok &= got == expected
        print(f"{'ok ' if got == expected else 'BAD'} chat {user!r} (system={system}) -> {got!r}")
    return ok


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options; the defaults rebuild the shipped model exactly."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEMO_MODEL_DIR, help="output folder")
    parser.add_argument("--steps", type=int, default=1500, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=0, help="seed for init and batch order")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1:
        parser.error("--steps and --batch-size must be positive integers")
    return args


def main(argv: list[str] | None = None) -> int:
    """Build, train, save and verify; exit status 1 if any verification fails."""
    args = parse_args(argv)
    torch.set_num_threads(1)  # one thread: reproducible sums, and the CPU is shared
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer()
    model = LlamaForCausalLM(build_config(tokenizer))
    samples = text_samples(tokenizer) + chat_samples(tokenizer)
    batches = make_batches(samples, tokenizer.pad_token_id, args.batch_size)
    print(
        f"{len(samples)} samples, {len(batches)} batches, "
        f"{sum(p.numel() for p in model.parameters())} parameters",
        flush=True,
    )
    start = time.perf_counter()
    train(model, batches, args.steps, args.seed)
    print(
        f"trained in {time.perf_counter() - start:.0f} s; "
        f"final mean loss {mean_loss(model, batches):.5f}",
        flush=True,
    )
    save(model, tokenizer, args.out)
    return 0 if verify(args.out) else 1


if __name__ == "__main__":
    sys.exit(main())
