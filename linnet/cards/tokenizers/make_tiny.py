"""Train the tiny tokenizer (linnet/cards/tokenizers/tiny) on linnet.data.synthetic_tasks chats.

Run from the repository root:

    python -m linnet.cards.tokenizers.make_tiny

A byte-level BPE of exactly 512 tokens, laid out like Llama 3's: special tokens
<|begin_of_text|> (bos) to <|pad|>, a bos added by plain `tokenizer(text)`, and
a Llama-3-instruct chat template whose turns end in <|eot_id|> (eos). It writes
tokenizer.json and tokenizer_config.json, the same bytes on every run.
"""

import argparse
import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from linnet.data.synthetic_tasks import generate, messages

VOCAB_SIZE = 512
# In this order, so the ids match the tiny-llama card: bos 0, eos (<|eot_id|>) 4.
SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|pad|>",
)
BOS, EOS, PAD = "<|begin_of_text|>", "<|eot_id|>", "<|pad|>"
TRAIN_ROWS = 4000
# Not the data set's seed, so the tokenizer is not fitted to the exact rows it encodes.
TRAIN_SEED = 1

# Llama 3's split pattern, except that digits stand alone (\p{N}, not \p{N}{1,3}):
# a tiny model learns sums and orderings far sooner digit by digit.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Llama 3 instruct's template, without a system prompt of its own.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)


def training_text():
    """Each turn as the chat template lays it out between its special tokens."""
    for row in generate(TRAIN_ROWS, TRAIN_SEED):
        for message in messages(row):
            yield message["role"]
            yield "\n\n" + message["content"]


def build() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 bytes, so any text encodes even if the training text lacks a byte.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(), trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained {tokenizer.get_vocab_size()} tokens, not {VOCAB_SIZE}")
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BOS} $A",
            pair=f"{BOS} $A {BOS}:1 $B:1",
            special_tokens=[(BOS, tokenizer.token_to_id(BOS))],
        ),
    ])
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "tiny")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    build().save(str(args.out / "tokenizer.json"))
    # Written by hand rather than by save_pretrained, whose output (and where it
    # puts the chat template) changes between transformers versions.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 2048,
    }
    with open(args.out / "tokenizer_config.json", "w", encoding="utf-8", newline="\n") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
