"""`loss_packed` on a row packed from several documents equals, token for
token, the losses of each document run alone: attention never crosses a
document, and positions restart at each."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from linnet import nest

LENGTHS = [7, 11, 5]  # three documents, then padding
ROW = 28
GENERICS = {"Batch": 1, "MaxSeq": ROW, "T": "f32"}


def packed_row():
    g = torch.Generator().manual_seed(3)
    documents = [torch.randint(0, 512, (n,), generator=g) for n in LENGTHS]
    tokens = torch.zeros(ROW, dtype=torch.long)
    targets, positions = torch.zeros_like(tokens), torch.zeros_like(tokens)
    segments = torch.full_like(tokens, len(LENGTHS))  # padding is a segment of its own
    start = 0
    for index, doc in enumerate(documents):
        span = slice(start, start + len(doc))
        tokens[span], segments[span] = doc, index
        targets[start:start + len(doc) - 1] = doc[1:]
        positions[span] = torch.arange(len(doc))
        start += len(doc)
    return documents, tokens[None], targets[None], positions[None], segments[None]


def token_losses(loss, count: int, *inputs) -> list[float]:
    """Each position's own loss: the weighted mean with all weight on it."""
    out = []
    for t in range(count):
        weights = torch.zeros(1, count)
        weights[0, t] = 1.0
        out.append(float(loss(*inputs, weights)))
    return out


@pytest.mark.parametrize("backend, numerics",
                         [("torch", "exact"), ("torch", "fast"), ("jax_source", "exact"), ("jax_source", "fast")])
def test_packed_row_equals_documents_alone(backend, numerics):
    model = nest.load("tiny-llama", backend=backend, numerics=numerics, generics=GENERICS)
    if backend == "jax_source":
        import jax.numpy as jnp

        convert = lambda t: jnp.asarray(t.numpy())  # noqa: E731
    else:
        convert = lambda t: t  # noqa: E731
    documents, tokens, targets, positions, segments = packed_row()
    packed = token_losses(lambda *a: model.loss_packed(*map(convert, a)), ROW, tokens, targets, positions, segments)
    start = 0
    for doc in documents:
        doc_tokens, doc_targets = doc[None], torch.roll(doc, -1)[None]
        alone = token_losses(lambda *a: model.loss(*map(convert, a)), len(doc), doc_tokens, doc_targets)
        # the last token of a document predicts nothing inside it; compare the rest
        np.testing.assert_allclose(packed[start:start + len(doc) - 1], alone[:-1], rtol=1e-5, atol=1e-5)
        start += len(doc)


def test_padding_and_other_documents_do_not_change_a_documents_loss():
    model = nest.load("tiny-llama", generics=GENERICS)
    documents, tokens, targets, positions, segments = packed_row()
    weights = torch.zeros(1, ROW)
    weights[0, :LENGTHS[0] - 1] = 1.0
    before = model.loss_packed(tokens, targets, positions, segments, weights)
    scrambled = tokens.clone()
    scrambled[0, LENGTHS[0]:] = torch.randint(0, 512, (ROW - LENGTHS[0],))
    after = model.loss_packed(scrambled, targets, positions, segments, weights)
    assert float(before) == float(after)
