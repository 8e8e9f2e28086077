"""Where a card can come from (`linnet.cards.resolve`): a Hugging Face model folder, a hub id in the local
Hugging Face cache, a `Card` held in memory; each read afresh, and each building the model it describes."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from hf_models import LLAMA3_SCALING, save_hf_llama
from linnet import nest
from linnet.cards import CARDS_DIR, UnknownCard, resolve
from linnet.cards.huggingface import NotAModel
from linnet.hf.read import weight_specs

GENERICS = {"Batch": 1, "MaxSeq": 12, "T": "f32"}


def tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, GENERICS["MaxSeq"]), generator=torch.Generator().manual_seed(3),
                         dtype=torch.int32)


def transformers_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    return model.eval()(ids.long()).logits


def rewrite_rope(config: dict, spelling: str) -> dict:
    """config.json as transformers 5.x writes it (rope_parameters), rewritten in an older spelling."""
    rope = dict(config.pop("rope_parameters"))
    theta = rope.pop("rope_theta")
    match spelling:
        case "rope_parameters":
            return {**config, "rope_parameters": {**rope, "rope_theta": theta}}
        case "rope_scaling":  # transformers 4.x
            return {**config, "rope_theta": theta, "rope_scaling": None if rope["rope_type"] == "default" else rope}
        case "type":  # older 4.x: "type" for "rope_type"
            return {**config, "rope_theta": theta, "rope_scaling": {"type": rope.pop("rope_type"), **rope}}


@pytest.mark.parametrize("spelling", ["rope_parameters", "rope_scaling", "type"])
@pytest.mark.parametrize("scaling", [LLAMA3_SCALING, None], ids=["llama3", "default"])
def test_a_model_folder_is_a_card_in_any_spelling_of_its_rope(tmp_path, spelling, scaling):
    toml_card = save_hf_llama(tmp_path, rope_scaling=scaling)
    folder = tmp_path / "hf"
    written = json.loads((folder / "config.json").read_text())
    assert "rope_parameters" in written  # what transformers 5.x writes
    (folder / "config.json").write_text(json.dumps(rewrite_rope(written, spelling)))

    card = resolve(folder)
    assert (card.family, card.weights.repo) == ("llama", str(folder.resolve()))
    ids = tokens(card.config["vocab_size"])
    from_folder = nest.load(folder, generics=GENERICS, entry="logits")(ids)
    torch.testing.assert_close(from_folder, nest.load(toml_card, generics=GENERICS, entry="logits")(ids),
                               rtol=0, atol=0)
    torch.testing.assert_close(from_folder, transformers_logits(folder, ids), rtol=2e-5, atol=2e-5)


def test_a_hub_id_in_the_local_cache_is_a_card(tmp_path, monkeypatch):
    from huggingface_hub import constants

    save_hf_llama(tmp_path)
    commit = "0" * 40  # the cache's layout: models--ORG--NAME/{refs/main, snapshots/COMMIT/...}
    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    shutil.copytree(tmp_path / "hf", repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    card = resolve("tiny-org/tiny-llama")
    assert card.name == "tiny-org/tiny-llama" and Path(card.weights.repo) == (repo / "snapshots" / commit).resolve()
    ids = tokens(card.config["vocab_size"])
    torch.testing.assert_close(nest.load("tiny-org/tiny-llama", generics=GENERICS, entry="logits")(ids),
                               transformers_logits(tmp_path / "hf", ids), rtol=2e-5, atol=2e-5)
    with pytest.raises(UnknownCard, match=r"'tiny-org/absent' is not in the local Hugging Face cache"
                                          r".*huggingface-cli download tiny-org/absent"):
        resolve("tiny-org/absent")


def test_a_card_in_memory_builds_its_own_config_and_save_weights_describes_it(tmp_path):
    on_disk = resolve("tiny-llama")
    card = dataclasses.replace(on_disk, config={**on_disk.config, "num_hidden_layers": 3},
                               path=tmp_path / "nowhere.toml")
    assert resolve(card) is card
    layers = {spec.index for spec in weight_specs(card.checked()) if spec.index is not None}
    assert layers == {0, 1, 2} and on_disk.config["num_hidden_layers"] == 2

    model = nest.load(card, generics=GENERICS, entry="logits", weights="random")
    ids = tokens(card.config["vocab_size"])
    expected = model(ids)
    folder = model.save_weights(tmp_path / "out", dtype=torch.float32)
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 3
    torch.testing.assert_close(transformers_logits(folder, ids), expected, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(nest.load(folder, generics=GENERICS, entry="logits")(ids), expected, rtol=0, atol=0)


def test_an_edited_card_is_read_again(tmp_path):
    path = tmp_path / "mine.toml"
    text = (CARDS_DIR / "tiny-llama.toml").read_text().replace('repo = "tokenizers/tiny"',
                                                               f'repo = "{CARDS_DIR / "tokenizers" / "tiny"}"')
    path.write_text(text)
    assert resolve(path).checked().repeat("Layer") == 2
    path.write_text(text.replace("num_hidden_layers = 2", "num_hidden_layers = 4"))
    assert resolve(path).checked().repeat("Layer") == 4
    assert nest.load(path, generics=GENERICS, entry="logits", weights="random").checked.repeat("Layer") == 4


def test_a_shipped_name_wins_over_a_folder_of_that_name_unless_written_as_a_path(tmp_path, monkeypatch):
    save_hf_llama(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf").rename(tmp_path / "tiny-llama")  # e.g. an --out folder named after the card
    assert resolve("tiny-llama").path == CARDS_DIR / "tiny-llama.toml"
    assert resolve("./tiny-llama").weights.repo == str(tmp_path / "tiny-llama")


@pytest.mark.parametrize("config, message", [
    (None, r"holds no config.json: a folder given as a card must be a Hugging Face model folder"),
    ("{not json", r"config.json is not valid JSON"),
    ({"model_type": "gpt2"}, r"model_type 'gpt2' has no family in Linnet; supported: .*llama"),
    ({"model_type": "llama", "architectures": ["LlamaForSequenceClassification"]},
     r"architectures \['LlamaForSequenceClassification'\] hold no causal language model"),
])
def test_a_folder_that_is_not_a_model_says_why(tmp_path, config, message):
    if config is not None:
        (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(NotAModel, match=message):
        resolve(tmp_path)


def test_an_unknown_name_lists_every_kind_of_card():
    with pytest.raises(UnknownCard, match=r"unknown card 'tiny-lama' \(did you mean 'tiny-llama'\?\): "
                                          r"give a shipped card's name .* "
                                          r"a Hugging Face model folder, or a hub id in the local Hugging Face cache"):
        resolve("tiny-lama")


def test_a_llama_folder_without_head_dim_takes_hidden_size_over_heads(tmp_path):
    """Llama 3.1's published config.json has no head_dim: transformers takes hidden_size / heads, and so does the
    card."""
    save_hf_llama(tmp_path)
    folder = tmp_path / "hf"
    config = json.loads((folder / "config.json").read_text())
    assert config.pop("head_dim") == config["hidden_size"] // config["num_attention_heads"]
    (folder / "config.json").write_text(json.dumps(config))
    ids = tokens(config["vocab_size"])
    torch.testing.assert_close(nest.load(folder, generics=GENERICS, entry="logits")(ids),
                               transformers_logits(folder, ids), rtol=2e-5, atol=2e-5)
    written = nest.load(folder, generics=GENERICS, entry="logits").save_weights(tmp_path / "out", dtype=torch.float32)
    head_dim = json.loads((written / "config.json").read_text())["head_dim"]
    assert head_dim == config["hidden_size"] // config["num_attention_heads"]


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2", "mistral"])
def test_a_folder_of_each_family_is_a_card(tmp_path, model_type):
    from hf_models import save_hf_model
    from test_families import family_config

    save_hf_model(tmp_path, model_type, **family_config(model_type, False))
    folder = tmp_path / "hf"
    ids = tokens(json.loads((folder / "config.json").read_text())["vocab_size"])
    torch.testing.assert_close(nest.load(folder, generics=GENERICS, entry="logits")(ids),
                               transformers_logits(folder, ids), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("key,meant", [("rope_scalling", "rope_scaling"), ("hiden_act", "hidden_act")])
def test_a_misspelled_card_key_is_refused_naming_the_card_the_key_and_the_one_meant(tmp_path, key, meant):
    from linnet.cardlang import CardError

    text = (CARDS_DIR / "tiny-llama.toml").read_text().replace('repo = "tokenizers/tiny"',
                                                                f'repo = "{CARDS_DIR / "tokenizers" / "tiny"}"')
    text = text.replace("rope_scaling =", f"{key} =") if key == "rope_scalling" else text + f'{key} = "silu"\n'
    card = tmp_path / "misspelled.toml"
    card.write_text(text)
    line = next(n for n, written in enumerate(text.splitlines(), 1) if written.startswith(f"{key} ="))
    with pytest.raises(CardError, match=rf"misspelled.toml:{line}: \[config\] {key} is not a setting llama.arch "
                                        rf"reads \(did you mean {meant}\?\)"):
        resolve(card).checked()


def test_a_model_folders_config_keeps_the_keys_transformers_writes(tmp_path):
    folder = Path(resolve(save_hf_llama(tmp_path / "hf")).weights.repo)
    config = json.loads((folder / "config.json").read_text())
    config["a_setting_of_a_newer_transformers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    card = resolve(folder)
    assert {"initializer_range", "a_setting_of_a_newer_transformers"} <= set(card.config) and card.checked()
