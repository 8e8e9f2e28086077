"""`linnet.torch.fully_shard` on transformers' own models, with FSDP2's call pattern (a call on each decoder
layer, then on the model), trained in the user's own loop: against one process training transformers'
model unsharded, for each family, tied and untied, over 2 and 3 Gloo ranks, on plain, padded and packed
rows, with clip_grad_norm_; then the rest of the API (mp_policy, accumulation, save_pretrained, the
meta device) and what is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distributed import run
from hf_models import make_hf_model
from test_families import FAMILIES

LIMIT_S = 300
CASES = [(model_type, tie) for model_type in ["llama", *FAMILIES] for tie in (True, False)]
STEPS, LENGTH, VOCAB = 3, 20, 211
MAX_NORM = 0.5  # below the tiny models' gradient norms: every step clips


def case_model(model_type: str, tie: bool):
    overrides = {**({} if model_type == "llama" else FAMILIES[model_type]), "tie_word_embeddings": tie}
    return make_hf_model(model_type, seed=0, **overrides)


def batch(step: int, rank: int) -> dict:
    """Rank `rank`'s rows at `step`: plain rows with a prompt that takes no loss; rows padded on the right
    (attention_mask); one row of three documents packed by position_ids."""
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(1, VOCAB, (2, LENGTH), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    match step % 3:
        case 0:
            return dict(input_ids=ids, labels=labels)
        case 1:
            mask = torch.ones_like(ids)
            mask[1, 14:] = 0
            ids[1, 14:], labels[1, 14:] = 0, -100
            return dict(input_ids=ids, labels=labels, attention_mask=mask)
        case _:
            positions = torch.cat([torch.arange(7), torch.arange(9), torch.arange(4)])[None]
            labels = ids[:1].clone()
            labels[0, [0, 7, 16]] = -100  # each document's first token, as TRL's padding-free collator
            return dict(input_ids=ids[:1], labels=labels, position_ids=positions)


def adamw(params):
    # eps raised from 1e-8: at 1e-8 an element whose gradient is rounding moves a full step either way
    # (tests/test_fully_shard.py's relative_error says more)
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-3, weight_decay=0.01)


def train_sharded(rank: int, world: int, cases: list) -> list:
    from linnet.torch import fully_shard

    results = []
    for model_type, tie in cases:
        model = case_model(model_type, tie)
        for layer in model.model.layers:
            fully_shard(layer)
        assert fully_shard(model) is model
        optimizer = adamw(model.parameters())
        losses, norms = [], []
        for step in range(STEPS):
            loss = model(**batch(step, rank), use_cache=False).loss
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).full_tensor()))
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
        weights = {name: tensor.numpy() for name, tensor in model.state_dict().items()}
        results.append((losses, norms, weights if rank == 0 else None))
    return results


def train_alone(model_type: str, tie: bool, world: int):
    """One process, transformers' model unsharded: each step the mean of the ranks' losses."""
    model = case_model(model_type, tie)
    optimizer = adamw(model.parameters())
    losses, norms = [], []
    for step in range(STEPS):
        rank_losses = [model(**batch(step, rank), use_cache=False).loss for rank in range(world)]
        (sum(rank_losses) / world).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append([float(loss) for loss in rank_losses])
    return losses, norms, {name: tensor.detach().numpy() for name, tensor in model.state_dict().items()}


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


@pytest.mark.parametrize("world", [2, 3])  # 3: every group padded
def test_each_family_trains_as_one_process_in_the_users_loop(world):
    results = run(train_sharded, world, CASES, timeout=LIMIT_S)
    for index, (model_type, tie) in enumerate(CASES):
        label = f"{model_type} {'tied' if tie else 'untied'}"
        expected_losses, expected_norms, expected_weights = train_alone(model_type, tie, world)
        for rank, rank_results in enumerate(results):
            losses, norms, _ = rank_results[index]
            np.testing.assert_allclose(losses, [step[rank] for step in expected_losses], rtol=1e-5, err_msg=label)
            np.testing.assert_allclose(norms, expected_norms, rtol=1e-5, err_msg=label)
        weights = results[0][index][2]
        assert weights.keys() == expected_weights.keys(), label
        for name, tensor in weights.items():
            assert relative_error(tensor, expected_weights[name]) < 5e-5, f"{label}: {name}"
