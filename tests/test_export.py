"""Writing Hugging Face checkpoints: the plan of the files, SafeTensors written by
hand read back by safetensors, transformers and Linnet; sharded saves equal
unsharded ones; a failed write leaves nothing behind and reaches every rank."""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distributed import run
import linnet.hf.write
from linnet import nest
from linnet.cards import resolve
from linnet.hf.write import computed_config, parse_size, plan_files, write_hf_checkpoint

GENERICS = {"Batch": 1, "MaxSeq": 32, "T": "f32"}
TOKENS = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(3))
CARD = resolve("tiny-llama")
SHAPES = {"a.weight": (7, 5), "b.weight": (3,), "c.scale": (), "d.weight": (11, 13), "e.weight": (2, 3, 5)}


def load():
    """tiny-llama (about 1 MB in f32) with seeded random f32 weights."""
    return nest.load("tiny-llama", generics=GENERICS, numerics="exact", cast_dtype=True, trainable=True,
                     weights="random", seed=0)


def random_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def weight_files(folder: Path) -> dict[str, bytes]:
    """Each file's bytes, with the save's id (linnet.hf.read.SAVE_KEY) blanked: the same weights saved twice
    differ in it alone."""
    return {path.name: re.sub(rb'"linnet_save": ?"[0-9a-f]{32}"', b'"linnet_save":""', path.read_bytes())
            for path in sorted(folder.iterdir())}


def test_plan_fills_files_in_order_and_gives_a_larger_tensor_its_own():
    assert plan_files({"a": 40, "b": 60, "c": 150, "d": 30, "e": 71}, 100) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert plan_files({"a": 40, "b": 150, "c": 30}, 100) == [["a"], ["b"], ["c"]]
    assert plan_files({"a": 40, "b": 60}, "5GB") == [["a", "b"]]
    sizes = [parse_size(s) for s in ("5GB", "500MB", "10kb", "1.5 MB", 123)]
    assert sizes == [5 * 10**9, 5 * 10**8, 10**4, 1_500_000, 123]
    with pytest.raises(ValueError, match=r"max_shard_size takes .* got '5GiB'"):
        parse_size("5GiB")


def test_plan_is_huggingface_hubs_where_no_tensor_passes_the_limit():
    from huggingface_hub import split_torch_state_dict_into_shards

    tensors = {f"t{i}": torch.zeros(n) for i, n in enumerate([30, 20, 50, 10, 90, 40, 40, 1, 99])}
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=400)
    assert list(split.filename_to_tensors.values()) == plan_files({n: t.nbytes for n, t in tensors.items()}, 400)


# What the tiny card leaves to llama.arch's defaults, written out as the model computed them.
LEFT_TO_DEFAULTS = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
                    "partial_rotary_factor": 1.0, "sliding_window": None}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_files_read_back_by_safetensors_bit_for_bit(tmp_path, dtype):
    tensors = random_tensors()
    folder = write_hf_checkpoint(CARD, SHAPES, iter(tensors.items()), tmp_path / "out", dtype, max_shard_size=200)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted({*index["weight_map"].values()})
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert index["metadata"]["total_size"] == sum(t.numel() for t in tensors.values()) * dtype.itemsize
    read = {name: (file, tensor) for file in files for name, tensor in load_file(folder / file).items()}
    assert list(read) == list(SHAPES) and index["weight_map"] == {name: file for name, (file, _) in read.items()}
    for name, tensor in tensors.items():
        assert read[name][1].dtype == dtype and torch.equal(read[name][1], tensor.to(dtype)), name
    config = json.loads((folder / "config.json").read_text())
    name = str(dtype).removeprefix("torch.")
    assert config == {**CARD.config, **LEFT_TO_DEFAULTS, "torch_dtype": name, "dtype": name}


def test_the_config_names_the_dtype_written_whatever_the_source_said(tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_models import save_hf_llama

    card = save_hf_llama(tmp_path / "source", dtype=torch.float32)  # its config.json says "dtype": "float32"
    model = nest.load(card, generics={"Batch": 1, "MaxSeq": 16, "T": "f32"}, cast_dtype=True, trainable=True)
    folder = model.save_weights(tmp_path / "out", dtype=torch.bfloat16)
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(folder, dtype="auto").dtype == torch.bfloat16


def serving_files(folder: Path) -> list[str]:
    """What a save writes beside the weights and their config for the tiny card: its tokenizer and
    generation_config.json."""
    write_hf_checkpoint(CARD, SHAPES, iter(random_tensors().items()), folder, torch.float32)
    return sorted(p.name for p in folder.iterdir() if p.name not in ("config.json", "model.safetensors"))


def test_a_new_save_replaces_the_weight_files_of_an_earlier_one(tmp_path):
    serving = serving_files(tmp_path / "serving")
    assert {"generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(serving)
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "README.md").write_text("mine")
    write_hf_checkpoint(CARD, SHAPES, iter(random_tensors().items()), folder, torch.float32, max_shard_size=200)
    write_hf_checkpoint(CARD, SHAPES, iter(random_tensors(1).items()), folder, torch.float32)
    assert sorted(weight_files(folder)) == sorted(["README.md", "config.json", "model.safetensors", *serving])
    write_hf_checkpoint(CARD, SHAPES, iter(random_tensors(2).items()), folder, torch.float32, max_shard_size=200)
    assert "model.safetensors" not in weight_files(folder) and "README.md" in weight_files(folder)
    assert sorted(tmp_path.iterdir()) == [folder, tmp_path / "serving"]


def test_a_save_keeps_the_folders_own_files_links_and_folders(tmp_path):
    serving = serving_files(tmp_path / "serving")
    folder = tmp_path / "out"
    write_hf_checkpoint(CARD, SHAPES, iter(random_tensors().items()), folder, torch.float32, max_shard_size=200)
    (folder / "notes.txt").write_text("{}")
    (folder / "runs").mkdir()
    (folder / "runs" / "log.txt").write_text("step 1")
    (folder / "latest").symlink_to("runs")
    write_hf_checkpoint(CARD, SHAPES, iter(random_tensors(1).items()), folder, torch.float32)
    assert sorted(p.name for p in folder.iterdir()) == sorted(["config.json", "latest", "model.safetensors", "runs",
                                                                "notes.txt", *serving])
    assert (folder / "latest" / "log.txt").read_text() == "step 1" and (folder / "notes.txt").read_text() == "{}"


def test_weights_of_two_saves_mixed_by_a_save_cut_short_are_refused_by_name(tmp_path, monkeypatch):
    folder = tmp_path / "out"
    load().save_weights(folder, dtype=torch.float32, max_shard_size="200KB")
    replace, moved = os.replace, []

    def killed_after_two(source, target):  # the second save dies among its renames
        if len(moved) == 2:
            raise KeyboardInterrupt("killed")
        moved.append(target)
        replace(source, target)

    monkeypatch.setattr(linnet.hf.write.os, "replace", killed_after_two)
    again = nest.load("tiny-llama", generics=GENERICS, numerics="exact", cast_dtype=True, trainable=True,
                      weights="random", seed=1)
    with pytest.raises(KeyboardInterrupt):
        again.save_weights(folder, dtype=torch.float32, max_shard_size="200KB")
    with pytest.raises(ValueError, match=f"the weights in {re.escape(str(folder))} come from more than one save "
                                         r"\(linnet_save model-00001-of-000\d\d.safetensors: [0-9a-f]{32}, .*a "
                                         r"save_weights was cut short as it moved its files in. "
                                         r"Save the weights again"):
        nest.load("tiny-llama", generics=GENERICS, weights=folder)


def test_several_files_load_in_transformers_and_back_in_linnet(tmp_path):
    from transformers import AutoModelForCausalLM

    model = load()
    model.save_weights(tmp_path / "out", dtype=torch.float32, max_shard_size="200KB")
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 3
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    with torch.no_grad():
        expected = model.logits(TOKENS)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
        torch.testing.assert_close(reloaded(input_ids=TOKENS).logits, expected, rtol=1e-5, atol=1e-5)
        again = nest.load("tiny-llama", generics=GENERICS, numerics="exact", weights=tmp_path / "out")
        for (name, tensor), (name_read, read) in zip(model.named_weights(), again.named_weights(), strict=True):
            assert name == name_read and torch.equal(tensor, read), name
        torch.testing.assert_close(again.logits(TOKENS), expected, rtol=0, atol=0)


def fails_after(count: int, error: Exception):
    """(name, tensor) of random_tensors, then `error` where the count-th would be."""
    yield from list(random_tensors().items())[:count]
    raise error


@pytest.mark.parametrize("tensors, message", [
    (lambda: fails_after(3, OSError("lost the source")), "OSError: lost the source"),
    (lambda: iter(list(random_tensors().items())[:4]), r"the tensors ended before e.weight, \(2, 3, 5\)"),
    (lambda: iter([*random_tensors().items(), ("f.weight", torch.zeros(1))]), "got f.weight after the last of the 5"),
    (lambda: iter(reversed(random_tensors().items())),
     r"expected a.weight of shape \(7, 5\) next, got e.weight of shape \(2, 3, 5\)"),
])
def test_a_failed_write_leaves_nothing_and_names_the_folder(tmp_path, tensors, message):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError, match=f"writing the weights to {re.escape(str(target))} failed: .*{message}"):
        write_hf_checkpoint(CARD, SHAPES, tensors(), target, torch.float32, max_shard_size=200)
    assert list(tmp_path.iterdir()) == []


def test_a_save_under_a_file_leaves_nothing_and_names_the_folder(tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    target = tmp_path / "a-file" / "out"
    with pytest.raises(RuntimeError,
                       match=f"writing the weights to {re.escape(str(target))} failed: NotADirectoryError"):
        load().save_weights(target)
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]


def sharded_saves(rank: int, world: int, folder: str) -> str | None:
    """A sharded save, then a second one into the same folder whose first rank's disk fills after one file."""
    import os

    from linnet.torch import fully_shard

    model = fully_shard(load())
    model.save_weights(folder, max_shard_size="100KB")
    fsync = os.fsync
    if rank == 0:
        def disk_full(fd):
            raise OSError(errno.ENOSPC, "No space left on device")

        os.fsync = disk_full
    try:
        model.save_weights(folder, max_shard_size="100KB")
    except RuntimeError as error:
        return str(error)
    finally:
        os.fsync = fsync  # the rank's process runs the next test's function too (tests/distributed.py)
    return None


def test_sharded_save_writes_the_unsharded_files_and_a_failure_reaches_every_rank(tmp_path):
    load().save_weights(tmp_path / "unsharded", max_shard_size="100KB")
    first, second = run(sharded_saves, 2, str(tmp_path / "sharded"), timeout=120)
    assert len(weight_files(tmp_path / "unsharded")) > 3
    assert weight_files(tmp_path / "sharded") == weight_files(tmp_path / "unsharded")  # the failed save changed nothing
    folder = tmp_path / "sharded"
    assert first == f"writing the weights to {folder} failed: OSError: [Errno 28] No space left on device"
    assert second == f"could not write the weights to {folder}: rank 0: RuntimeError: {first}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sharded", "unsharded"]


def test_a_key_the_card_leaves_to_its_family_is_written_as_the_model_computed_it():
    """Mistral's card leaves sliding_window out (TOML has no null): no window. transformers' MistralConfig
    would read a missing key as a window of 4096, so config.json says null."""
    card = resolve("mistral-7b-v0.3")
    assert "sliding_window" not in card.config
    config = computed_config(card)
    assert config["sliding_window"] is None and config["head_dim"] == 128 and config["hidden_act"] == "silu"


def test_the_tiny_cards_output_folder_is_a_model_transformers_generates_with(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    model = nest.load("tiny-llama", generics={"Batch": 1, "MaxSeq": 16, "T": "f32"}, cast_dtype=True, trainable=True,
                      weights="random")
    folder = model.save_weights(tmp_path / "out")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
    assert loaded.dtype == torch.bfloat16 and tokenizer.chat_template
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    generation = GenerationConfig.from_pretrained(folder)
    assert eot in (generation.eos_token_id if isinstance(generation.eos_token_id, list) else [generation.eos_token_id])
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "reverse: red green"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = loaded.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]


def test_a_card_without_a_tokenizer_writes_its_weights_and_says_so(tmp_path):
    from hf_models import save_hf_llama

    model = nest.load(save_hf_llama(tmp_path / "source"), generics={"Batch": 1, "MaxSeq": 16, "T": "f32"},
                      cast_dtype=True, trainable=True)
    with pytest.warns(UserWarning, match="no tokenizer written beside the weights: test-llama's"):
        folder = model.save_weights(tmp_path / "out")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
