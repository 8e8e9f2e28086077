"""Logits and losses of both backends against transformers' LlamaForCausalLM,
on tiny random models written by save_pretrained."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_models import LLAMA3_SCALING, load_hf, save_hf_llama
from linnet import nest

CONFIGS = {
    # grouped-query ratio 4, untied, llama3 rope scaling, hidden 80 (not a power of two)
    "gqa4-untied-llama3": dict(num_key_value_heads=1, tie_word_embeddings=False, rope_scaling=LLAMA3_SCALING),
    # ratio 1 (plain multi-head), tied, no rope scaling
    "mha-tied-plain": dict(num_key_value_heads=4, tie_word_embeddings=True, rope_scaling=None),
    # ratio 2, tied, llama3 scaling, hidden 72
    "gqa2-tied-llama3": dict(num_key_value_heads=2, tie_word_embeddings=True, rope_scaling=LLAMA3_SCALING,
                             hidden_size=72, head_dim=18),
}
BATCH, SEQ = 2, 48
GENERICS = {"Batch": BATCH, "MaxSeq": 64}


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    card = save_hf_llama(folder, **CONFIGS[request.param])
    tokens = torch.randint(0, 211, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    targets = torch.roll(tokens, -1, dims=1)
    weights = torch.ones(BATCH, SEQ)
    weights[:, -1] = 0.0  # the last position has no next token
    references = {}
    for dtype in (torch.float32, torch.bfloat16):
        hf = load_hf(card, dtype=dtype)
        with torch.no_grad():
            out = hf(input_ids=tokens, labels=tokens)
        references[dtype] = (out.logits.float(), out.loss.float())
    return card, tokens, targets, weights, references


def run(card, backend, numerics, dtype, tokens, targets, weights, **options):
    model = nest.load(card, backend=backend, numerics=numerics, generics={**GENERICS, "T": dtype}, **options)
    if backend == "jax_source":
        import jax.numpy as jnp

        as_jax = lambda t: jnp.asarray(t.numpy())  # noqa: E731
        logits = model.logits(as_jax(tokens))
        loss = model.loss(as_jax(tokens), as_jax(targets), as_jax(weights))
        return torch.from_numpy(np.array(logits, dtype=np.float32)), torch.tensor(float(loss))
    with torch.no_grad():
        return model.logits(tokens).float(), model.loss(tokens, targets, weights).float()


@pytest.mark.parametrize("backend", ["torch", "jax_source"])
@pytest.mark.parametrize("numerics", ["exact", "fast"])
def test_f32_matches_transformers(case, backend, numerics):
    card, tokens, targets, weights, references = case
    logits, loss = run(card, backend, numerics, "f32", tokens, targets, weights)
    ref_logits, ref_loss = references[torch.float32]
    # f32 throughout: only the order of summation differs (fused attention,
    # XLA's dot products), a few ulps on values of order 1; 1e-4 is the bar.
    assert (logits - ref_logits).abs().max() < 1e-4
    assert abs(loss - ref_loss) < 1e-4


@pytest.mark.parametrize("backend", ["torch", "jax_source"])
@pytest.mark.parametrize("numerics", ["exact", "fast"])
def test_bf16_as_close_as_transformers_bf16(case, backend, numerics):
    card, tokens, targets, weights, references = case
    logits, loss = run(card, backend, numerics, "bf16", tokens, targets, weights, cast_dtype=True)
    ref_logits, ref_loss = references[torch.float32]
    hf_logits, hf_loss = references[torch.bfloat16]
    # bf16 keeps 8 bits of mantissa, so no two bf16 computations agree to f32
    # precision. The bar: our distance from the f32 truth is at most twice
    # transformers' own bf16 distance from it (plus a hair for an exact tie).
    hf_error = (hf_logits - ref_logits).abs().max()
    assert (logits - ref_logits).abs().max() <= 2 * hf_error + 1e-3
    assert abs(loss - ref_loss) <= 2 * abs(hf_loss - ref_loss) + 2e-3


def test_exact_torch_is_transformers_bit_for_bit(case):
    card, tokens, targets, weights, references = case
    logits, _ = run(card, "torch", "exact", "f32", tokens, targets, weights)
    torch.testing.assert_close(logits, references[torch.float32][0], rtol=0, atol=0)


def test_compiled_equals_eager(case):
    card, tokens, targets, weights, references = case
    if card.parent.name.startswith("mha"):  # one configuration is enough to prove the compiled path
        pytest.skip("compiled once, on the grouped-query configurations")
    eager = run(card, "torch", "fast", "f32", tokens, targets, weights)
    compiled = run(card, "torch", "fast", "f32", tokens, targets, weights, compile="inductor")
    assert (compiled[0] - eager[0]).abs().max() < 1e-5
    assert abs(compiled[1] - eager[1]) < 1e-5


@pytest.mark.parametrize("theta, scaling", [(500000.0, LLAMA3_SCALING), (10000.0, None)], ids=["llama3", "plain"])
def test_jax_rope_tables_are_torchs_at_long_positions(theta, scaling):
    """The angles grow with the position, and so does an ulp in a frequency: at 8,192 positions, one ulp in
    Llama 3's frequencies (numpy's f32 power) moved the tables by 5e-4."""
    from linnet.emit import prims_jax, prims_torch

    positions = np.arange(8192, dtype=np.int32)[None]
    expected = prims_torch.rope(torch.from_numpy(positions), 128, theta, scaling)
    for table, want in zip(prims_jax.rope(positions, 128, theta, scaling), expected):
        np.testing.assert_allclose(np.asarray(table), want.numpy(), rtol=0, atol=1e-6)  # cos, sin: XLA's own
