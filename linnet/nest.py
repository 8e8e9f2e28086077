"""Loading a card as a model: `nest.resolve` and `nest.load`.

    from linnet import nest
    model = nest.load("llama-3.2-1b", backend="torch", entry="logits", numerics="fast",
                      generics={"Batch": 2, "MaxSeq": 128, "T": "bf16"}, cast_dtype=True)
    logits = model.logits(tokens)

`load` parses and checks the card, binds the generics, emits source for the
backend and executes it, then reads the weights (or draws random ones when
asked) straight onto the device. `tokenizer(card)` is the card's tokenizer."""

from __future__ import annotations

from linnet.cards import Card, resolve
from linnet.errors import UserError
from linnet.cardlang.generics import bind_generics

__all__ = ["resolve", "load", "tokenizer"]


def load(
    card: str | Card,
    *,
    backend: str = "torch",
    entry: str | None = None,
    generics: dict,
    numerics: str = "exact",
    cast_dtype: bool = False,
    trainable: bool = False,
    compile: str | None = None,
    device=None,
    weights=None,
    seed: int = 0,
):
    """A model for `card`.

    backend: "torch" (generated PyTorch) or "jax_source" (generated jax.numpy).
    entry: one entry (`model(...)` calls it) or None for all of them.
    generics: every generic the card declares, e.g. {"Batch": 1, "MaxSeq": 4096, "T": "bf16"}.
    numerics: "exact" (transformers' order of computation) or "fast" (fused kernels).
    cast_dtype: keep f32 master weights and cast them to T where used.
    trainable: the PyTorch weights are parameters that require grad.
    compile: "inductor" compiles each entry with torch.compile(fullgraph=True); None runs eagerly.
    device: where the PyTorch weights live (default "cpu").
    weights: None for the card's own (its repo in the local Hugging Face cache, or random
        for a card that says so), a folder of SafeTensors, or "random".
    seed: the seed of random weights, drawn by the device's generator: the same seed gives the
        same weights on every GPU and at every world size, but other weights on a CPU.
    """
    card = resolve(card)
    checked = card.checked()
    generics = bind_generics(checked, generics)
    match numerics:
        case "exact" | "fast":
            pass
        case _:
            raise ValueError(f'numerics must be "exact" or "fast", got {numerics!r}')
    entries = checked.program.entries if entry is None else [entry]
    for name in entries:
        if name not in checked.program.entries:
            raise KeyError(f"unknown entry {name!r}: {card.name} has entries {', '.join(checked.program.entries)}")
    source = card.weights.repo if weights is None else weights
    random = source == "random" or (weights is None and card.weights.init == "random")
    match backend:
        case "torch":
            import torch

            from linnet.torch.model import TorchModel

            if compile not in (None, "inductor"):
                raise ValueError(f'compile must be None or "inductor", got {compile!r}')
            model = TorchModel(card, checked, generics=generics, numerics=numerics, cast_dtype=cast_dtype,
                               trainable=trainable, compile=compile, device=torch.device(device or "cpu"),
                               entries=entries)
        case "jax_source":
            from linnet.jax.model import JaxModel

            if compile is not None or trainable or device is not None:
                raise ValueError("backend='jax_source' is compiled by jax.jit and placed by JAX: compile=, "
                                 "trainable= and device= are PyTorch's")
            model = JaxModel(card, checked, generics=generics, numerics=numerics, cast_dtype=cast_dtype,
                             entries=entries)
        case _:
            raise ValueError(f'backend must be "torch" or "jax_source", got {backend!r}')
    if random:
        model.init_random(seed)
    else:
        model.load_checkpoint(source)
    return model


def tokenizer(card: str | Card):
    """transformers' tokenizer of `card`, from its weights' repo (in the local Hugging Face cache, or
    fetched) or folder; a UserError that says how to get it where it cannot be loaded."""
    from transformers import AutoTokenizer

    card = resolve(card)
    try:
        return AutoTokenizer.from_pretrained(card.weights.repo)
    except OSError as error:
        reason = str(error).split("\n")[0]
        raise UserError(f"no tokenizer for {card.name} from {card.weights.repo} ({reason}): download it first "
                        f"(`huggingface-cli download {card.weights.repo}`, logged in where the repo is gated)"
                        ) from None
