"""Reading weights: sharded checkpoints, the Hugging Face cache, and every way a
checkpoint can be wrong; writing them back for transformers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_models import load_hf, save_hf_llama, write_card, BASE
from linnet import nest
from linnet.cards import resolve

pytestmark = pytest.mark.quick

GENERICS = {"Batch": 1, "MaxSeq": 32, "T": "f32"}
TOKENS = torch.randint(0, 211, (1, 20), generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def card(tmp_path_factory) -> Path:
    return save_hf_llama(tmp_path_factory.mktemp("weights"), num_key_value_heads=2)


def reference_logits(card: Path) -> torch.Tensor:
    with torch.no_grad():
        return load_hf(card)(input_ids=TOKENS).logits


def checkpoint_copy(card: Path, tmp_path: Path, edit) -> Path:
    """A copy of the card's checkpoint with its tensors edited by `edit(dict)`."""
    folder = tmp_path / "edited"
    shutil.copytree(resolve(card).weights.repo, folder)
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_sharded_checkpoint_with_index(card, tmp_path):
    from transformers import LlamaForCausalLM

    LlamaForCausalLM.from_pretrained(resolve(card).weights.repo).save_pretrained(tmp_path / "sharded",
                                                                                max_shard_size="60KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    model = nest.load(card, generics=GENERICS, weights=tmp_path / "sharded")
    torch.testing.assert_close(model.logits(TOKENS), reference_logits(card), rtol=0, atol=0)


def test_hugging_face_cache_without_network(card, tmp_path, monkeypatch):
    import huggingface_hub.constants

    snapshot = tmp_path / "hub" / "models--someone--tiny" / "snapshots" / "abc123"
    shutil.copytree(resolve(card).weights.repo, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cached = write_card(tmp_path, BASE | {"num_key_value_heads": 2}, None, repo="someone/tiny", name="cached")
    assert nest.resolve(cached).weights.repo == "someone/tiny"
    model = nest.load(cached, generics=GENERICS)
    torch.testing.assert_close(model.logits(TOKENS), reference_logits(card), rtol=0, atol=0)


def test_no_weights_is_an_error_not_random(tmp_path):
    absent = write_card(tmp_path, BASE, None, repo="nobody/not-downloaded", name="absent")
    with pytest.raises(FileNotFoundError, match="weights='random'"):
        nest.load(absent, generics=GENERICS)
    nest.load(absent, generics=GENERICS, weights="random")  # asked for explicitly


def test_missing_tensor_is_named(card, tmp_path):
    folder = checkpoint_copy(card, tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing 1: model.layers.1.mlp.up_proj.weight"):
        nest.load(card, generics=GENERICS, weights=folder)


def test_extra_tensor_is_named(card, tmp_path):
    folder = checkpoint_copy(card, tmp_path, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(3)}))
    with pytest.raises(ValueError, match=r"not in the card 1: model.layers.0.mlp.extra.weight"):
        nest.load(card, generics=GENERICS, weights=folder)


def test_misshaped_tensor_names_both_shapes(card, tmp_path):
    def shrink(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(20, 80)

    folder = checkpoint_copy(card, tmp_path, shrink)
    with pytest.raises(ValueError,
                       match=r"model.layers.0.self_attn.k_proj.weight has shape \(20, 80\) .* expects \(40, 80\)"):
        nest.load(card, generics=GENERICS, weights=folder)


def test_inputs_are_checked_against_the_generics(card):
    model = nest.load(card, generics=GENERICS)
    with pytest.raises(ValueError, match=r"MaxSeq is at most 32"):
        model.logits(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(TypeError, match=r"expected an int tensor"):
        model.logits(torch.zeros(1, 8))
    with pytest.raises(ValueError, match=r"loss\(weights: f32\[Batch, MaxSeq\]\): MaxSeq is 7 here but 8"):
        model.loss(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long), torch.ones(1, 7))


def test_save_weights_loads_in_transformers(card, tmp_path):
    model = nest.load(card, generics=GENERICS, cast_dtype=True, trainable=True)
    model.save_weights(tmp_path / "out", dtype=torch.float32)
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=TOKENS).logits, reference_logits(card), rtol=0, atol=0)
