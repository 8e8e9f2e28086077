"""The start that every system of the benchmark table shares, so that their held-out losses can be
compared: for one shape, a random initialisation written once as a Hugging Face checkpoint
(Linnet's draw, bf16 SafeTensors under transformers' names, with its config.json, which every
system loads), and packed rows of the repo's instruction tasks (`linnet.data.synthetic_tasks`) to train on and to
hold out, as .npz arrays of Linnet's row fields.

    python3 benchmarks/shared_start.py --card llama-3.2-1b --out START [--rows 256] [--held-out 8]

writes START/init/ (config.json, model*.safetensors), START/rows.npz and START/held_out.npz. The
tokens come from the tiny card's tokenizer (byte-level BPE, 512 ids, valid ids of every Llama
vocabulary): no Llama tokenizer is reachable offline, and the systems only need the same ids.
Rank r of W trains on rows r, r + W, ...; every system reads the same file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from common import save_rows

from linnet import nest
from linnet.data.packing import Example, pack
from linnet.data.synthetic_tasks import generate

TOKENIZER = Path(__file__).parents[1] / "linnet" / "cards" / "tokenizers" / "tiny"


def task_rows(count: int, tokens: int, seed: int = 0) -> list:
    """`count` rows of `tokens` positions, packed from generated instruction tasks in the tiny
    tokenizer's chat template, the answer's tokens trained on (as examples/sft does)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    examples, made = [], 0
    while True:
        for row in generate(2000, seed + made):
            user = row["instruction"] + (f"\n\n{row['input']}" if row["input"] else "")
            text = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                                 tokenize=False)
            prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
            answer = tokenizer(row["output"] + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
            examples.append(Example.prompted(prompt, answer))
        made += 1
        rows = list(pack(examples, tokens))
        if len(rows) > count:  # the last row may be short of documents
            return rows[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--card", default="llama-3.2-1b")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=256,
                        help="rows to train on (a run of S steps on W GPUs reads S x W)")
    parser.add_argument("--held-out", type=int, default=8, help="rows no system trains on, for the held-out loss")
    parser.add_argument("--tokens", type=int, default=4096, help="positions in a row")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    rows = task_rows(args.held_out + args.rows, args.tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    save_rows(args.out / "held_out.npz", rows[: args.held_out])
    save_rows(args.out / "rows.npz", rows[args.held_out:])
    model = nest.load(args.card, backend="torch", generics={"Batch": 1, "MaxSeq": args.tokens, "T": "bf16"},
                      cast_dtype=True, weights="random", seed=0, device=args.device)
    model.save_weights(args.out / "init", dtype=torch.bfloat16)
    print(f"{args.out}: init/ ({args.card}, random, seed 0), {args.rows} rows and {args.held_out} held out "
          f"of {args.tokens} positions")


if __name__ == "__main__":
    main()
