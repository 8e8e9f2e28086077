"""A model loaded for a sharded run is read into parts: each rank draws or reads
only what its parts need, and gets exactly the unsharded model's values."""

from __future__ import annotations

from math import prod

import pytest
import torch

from distributed import run
from hf_models import save_hf_llama, write_tied_card
from linnet import nest

GENERICS = {"Batch": 1, "MaxSeq": 16, "T": "f32"}


def load(card, weights):
    return nest.load(card, numerics="exact", generics=GENERICS, cast_dtype=True, trainable=True, weights=weights,
                     seed=5, entry="loss_packed")


def flat_slices(model, sharding) -> list[torch.Tensor]:
    """Each group's flat buffer built from the whole model's weights by hand, cut to this rank's part."""
    weights = dict(model.params)
    out = []
    for decl in model.checked.program.groups.values():
        layout = sharding.layouts[decl.name]
        for group in (weights[decl.key] if decl.repeat is not None else [weights[decl.key]]):
            flat = torch.zeros(layout.total)
            for name, offset in zip(layout.names, layout.offsets):
                flat[offset:offset + group[name].numel()] = group[name].detach().reshape(-1)
            out.append(flat[sharding.rank * layout.part_size:(sharding.rank + 1) * layout.part_size])
    return out


def parts_and_reads(rank: int, world: int, card, weights) -> tuple[bool, int]:
    from linnet.torch import fully_shard
    from linnet.hf.read import SliceReader

    counted = []
    read = SliceReader.read

    def counting_read(self, spec, start, end):
        rows = read(self, spec, start, end)
        counted.append(self.bytes_read)
        return rows

    SliceReader.read = counting_read
    sharded = fully_shard(load(card, weights))
    assert sharded.weight_source is None
    expected = flat_slices(load(card, weights), sharded.sharding)
    parts = list(sharded.parameters())
    return (len(parts) == len(expected) and all(torch.equal(p, e) for p, e in zip(parts, expected)),
            max(counted, default=0))


@pytest.fixture(scope="module")
def tied_card(tmp_path_factory):
    """Tied, with groups that split unevenly over 3 and 4 ranks."""
    return write_tied_card(tmp_path_factory.mktemp("card"))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_random_parts_are_the_unsharded_models_at_any_world_size(tied_card, world):
    for equal, bytes_read in run(parts_and_reads, world, tied_card, "random", timeout=300):
        assert equal and bytes_read == 0


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory):
    """A checkpoint transformers wrote as several bf16 files and an index."""
    card = save_hf_llama(tmp_path_factory.mktemp("hf"), num_key_value_heads=2, max_shard_size="40KB",
                         dtype=torch.bfloat16)
    folder = card.parent / "hf"
    assert (folder / "model.safetensors.index.json").exists() and len(list(folder.glob("*.safetensors"))) >= 3
    return card, folder


def model_bytes(folder) -> tuple[int, int]:
    """(every tensor's bytes, the largest layer's) in a checkpoint folder."""
    from safetensors import safe_open

    sizes: dict[str, int] = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                group = name.split(".")[2] if name.startswith("model.layers.") else name
                sizes[group] = sizes.get(group, 0) + prod(f.get_slice(name).get_shape()) * 2
    return sum(sizes.values()), max(sizes.values())


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_a_checkpoint_in_several_files_loads_into_parts_reading_a_share(sharded_checkpoint, world):
    card, folder = sharded_checkpoint
    total, largest_group = model_bytes(folder)
    for equal, bytes_read in run(parts_and_reads, world, card, str(folder), timeout=300):
        assert equal
        assert total / world <= bytes_read <= total / world + largest_group


def test_a_model_too_large_to_hold_whole_is_refused_with_the_fix():
    model = nest.load("llama-3.1-70b", generics={"Batch": 1, "MaxSeq": 16, "T": "bf16"}, cast_dtype=True,
                      weights="random", entry="loss_packed")
    with pytest.raises(MemoryError, match=r"70\.\d+ billion parameters: its weights need 26\d\.\d GiB on the host.*"
                                          r"linnet\.torch\.fully_shard\(model\)"):
        model.parameters().__next__()
    assert model.weight_source is not None  # nothing was drawn; the model can still be sharded


def anonymous_memory() -> int:
    """Bytes of this process's anonymous resident memory (what it allocated, not files it maps)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))


def loading_peak(rank: int, world: int, card, source: str) -> tuple[int, int, int]:
    """(the most anonymous memory loading added, this rank's parts in bytes, the largest group in f32 bytes).
    source: "nest.load", or "meta" (transformers' model of the folder built on the meta device)."""
    import gc
    import threading

    from linnet.cards import resolve
    from linnet.torch import fully_shard
    from linnet.hf.read import SliceReader

    if source == "meta":
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(resolve(card).weights.repo),
                                                     dtype=torch.float32)
    else:
        model = load(card, None)
    gc.collect()
    base, peak, done = anonymous_memory(), [0], threading.Event()

    def sample():
        peak[0] = max(peak[0], anonymous_memory() - base)

    def poll():
        while not done.wait(0.001):
            sample()

    read = SliceReader.read

    # the peak is just after a read: the rows, the group's part, the parts so far
    def sampled_read(self, spec, start, end):
        rows = read(self, spec, start, end)
        sample()
        return rows

    SliceReader.read = sampled_read
    poller = threading.Thread(target=poll)
    poller.start()
    try:
        fully_shard(model)
        sample()
    finally:
        done.set()
        poller.join()
        SliceReader.read = read
    engine = model._linnet_engine if source == "meta" else model
    largest = max(layout.extent for layout in engine.sharding.layouts.values()) * 4
    return peak[0], sum(p.numel() * p.element_size() for p in engine.parameters()), largest


@pytest.mark.parametrize("source", ["nest.load", "meta"])
def test_loading_a_few_hundred_mb_holds_the_parts_and_one_group(tmp_path, source):
    card = save_hf_llama(tmp_path, vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_shard_size="100MB")
    assert sum(f.stat().st_size for f in (tmp_path / "hf").glob("*.safetensors")) > 200e6  # f32
    for peak, parts, group in run(loading_peak, 2, card, source, timeout=300, fresh=True):  # memory measured
        assert parts < peak <= (parts + group) * 1.1
