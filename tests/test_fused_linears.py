"""Products of one input made as one matrix product in sharded PyTorch code (linnet/emit/fused_linears.py, and
`_views`/`_linears` in linnet/torch/collectives.py). That the sharded model still trains as the unsharded one is
tests/test_fully_shard.py's."""

from __future__ import annotations

import pytest
import torch

from linnet import cards
from linnet.cardlang import check_program, parse_program
from linnet.cards import CARDS_DIR
from linnet.emit.jax_backend import JAX
from linnet.emit.fused_linears import runs_by_group, runs_in
from linnet.sharding.schedule import Schedule
from linnet.emit.source import emit
from linnet.emit.torch_backend import TORCH
from linnet.sharding.layout import GroupLayout
from linnet.torch.collectives import _linears, _pieces

pytestmark = pytest.mark.quick

GENERICS = {"Batch": 1, "MaxSeq": 4096, "T": "bf16"}
LLAMA = (CARDS_DIR / "llama.arch").read_text()
QKV = "h_q_proj, h_k_proj, h_v_proj = linears(h, w, ('q_proj', 'k_proj', 'v_proj'))"
GATE_UP = "h_gate_proj, h_up_proj = linears(h, w, ('gate_proj', 'up_proj'))"


def source(checked, backend=TORCH, schedule=Schedule(communicates=False)):
    return emit(checked, backend, card_name="tiny", generics=GENERICS, numerics="fast", cast_dtype=True,
                entries=["loss_packed"], schedule=schedule).source


def llama_with(old: str, new: str):
    card = cards.resolve("tiny-llama")
    assert old in LLAMA
    return check_program(parse_program(LLAMA.replace(old, new), "llama.arch"), card.config, "tiny-llama.toml")


def test_sharded_torch_code_makes_q_k_v_and_gate_up_as_one_product_each():
    written = source(cards.resolve("tiny-llama").checked())
    assert QKV in written and GATE_UP in written
    assert "q = rotate(split_heads(h_q_proj, Heads), cos, sin)" in written
    assert "return x + linear(silu(h_gate_proj) * h_up_proj, w['down_proj'])" in written
    assert "linear(h, w['q_proj'])" not in written and "linear(merge_heads(" in written  # o_proj reads another


@pytest.mark.parametrize("backend, schedule", [(TORCH, None), (JAX, Schedule(communicates=False))],
                         ids=["torch-unsharded", "jax-sharded"])
def test_other_code_keeps_one_product_a_weight(backend, schedule):
    checked = cards.resolve("tiny-llama").checked()
    written = emit(checked, backend, card_name="tiny", generics=GENERICS, numerics="fast", cast_dtype=True,
                   entries=["loss_packed"], sharded=schedule is not None, schedule=schedule).source
    assert "linears(" not in written and "q_proj" in written


def test_biased_projections_are_left_as_written():
    """Qwen2's q, k and v carry biases (`linear_bias`): only its gate and up make one product."""
    assert runs_by_group(cards.resolve("qwen2.5-0.5b").checked(),
                         list(cards.resolve("qwen2.5-0.5b").checked().program.functions.values())) == {
        "Layer": (("gate_proj", "up_proj"),)}


def test_an_input_changed_between_products_splits_the_run():
    """v read from another value of h: q and k still one product, v its own."""
    checked = llama_with("    v = split_heads(linear(h, w.v_proj), KVHeads)\n",
                         "    h = h * 2\n    v = split_heads(linear(h, w.v_proj), KVHeads)\n")
    runs = runs_in(checked.program.functions["decoder_layer"], checked)
    assert [run.names for run in runs] == [("q_proj", "k_proj"), ("gate_proj", "up_proj")]
    written = source(checked)
    assert "h_q_proj, h_k_proj = linears(h, w, ('q_proj', 'k_proj'))" in written
    assert "v = split_heads(linear(h, w['v_proj']), KVHeads)" in written


def test_a_name_the_card_uses_is_not_taken():
    checked = llama_with("    h = rms_norm(x, w.input_layernorm, eps=norm_eps)\n",
                         "    h = rms_norm(x, w.input_layernorm, eps=norm_eps)\n    h_q_proj = h\n")
    assert [run.names for run in runs_in(checked.program.functions["decoder_layer"], checked)] == [
        ("gate_proj", "up_proj")]


def test_a_run_is_one_matrix_only_where_its_weights_lie_side_by_side():
    runs = (("q", "k"),)
    together = GroupLayout("Layer", ("norm", "q", "k"), ((4,), (6, 4), (2, 4)), (0, 16, 40), 48, 48)
    assert _pieces(together, runs) == [("norm", 0, (4,)), (("q", "k"), 16, (8, 4))]
    apart = GroupLayout("Layer", ("norm", "q", "k"), ((4,), (6, 4), (2, 4)), (0, 16, 48), 64, 64)  # a gap after q
    assert _pieces(apart, runs) == [("norm", 0, (4,)), ("q", 16, (6, 4)), ("k", 48, (2, 4))]


def test_one_product_and_a_split_equal_one_a_weight():
    torch.manual_seed(0)
    x, q, k = (torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64),
               torch.randn(2, 4, dtype=torch.float64))
    separate = _linears(x, {"q": q, "k": k}, ("q", "k"))
    joined = _linears(x, {"q": q, "k": k, ("q", "k"): torch.cat([q, k])}, ("q", "k"))
    for one, other in zip(separate, joined):
        torch.testing.assert_close(one, other)
    assert [y.shape for y in joined] == [(3, 5, 6), (3, 5, 2)]


def test_the_gathered_views_hold_each_weight_and_the_run():
    from types import SimpleNamespace

    from linnet.torch.collectives import _views

    layout = GroupLayout("Layer", ("norm", "q", "k"), ((4,), (6, 4), (2, 4)), (0, 16, 40), 48, 48)
    sharding = SimpleNamespace(layouts={"Layer": layout}, products={"Layer": (("q", "k"),)})
    full = torch.arange(48.0)
    weights = _views(sharding, full, "Layer")
    assert torch.equal(weights["norm"], full[:4])
    assert torch.equal(weights["q"], full[16:40].view(6, 4)) and torch.equal(weights["k"], full[40:48].view(2, 4))
    assert torch.equal(weights[("q", "k")], full[16:48].view(8, 4))
