"""`linnet.torch.fully_shard` on transformers' own models, with FSDP2's call pattern (a call on each decoder
layer, then on the model), trained in the user's own loop: against one process training transformers'
model unsharded, for each family, tied and untied, over 2 and 3 Gloo ranks, on plain, padded and packed
rows, with clip_grad_norm_; then the rest of the API (mp_policy, accumulation, save_pretrained, the
meta device) and what is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distributed import free_port, run
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


def train_sharded(rank: int, world: int, cases: list, mesh_shape: tuple[int, int] | None = None) -> list:
    """Each case trained in the user's loop, over every rank, or over a ("replicate", "shard") mesh of
    `mesh_shape` (FSDP2's hybrid sharding)."""
    from torch.distributed.device_mesh import init_device_mesh

    from linnet.torch import fully_shard

    mesh = None if mesh_shape is None else init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    results = []
    for model_type, tie in cases:
        model = case_model(model_type, tie)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        assert fully_shard(model, mesh=mesh) is model
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
    assert_trained_as_one_process(run(train_sharded, world, CASES, timeout=LIMIT_S), CASES, world)


def test_a_2d_mesh_trains_as_one_process_in_the_users_loop():
    """FSDP2's hybrid sharding, 2 replicas of 2 shards: each part's gradient reduce-scattered inside its shard
    group and averaged across the replicas (the late parts, the first layer's and a tied embedding, by their
    hooks); clip_grad_norm_ over parameters replicated on one dimension of the mesh and sharded on the other."""
    cases = [("llama", True), ("qwen2", False)]
    assert_trained_as_one_process(run(train_sharded, 4, cases, (2, 2), timeout=LIMIT_S), cases, 4)


def assert_trained_as_one_process(results: list, cases: list, world: int) -> None:
    for index, (model_type, tie) in enumerate(cases):
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


def rest_of_the_api(rank: int, world: int, folder: str) -> dict:
    """mp_policy in bf16, accumulation with set_requires_gradient_sync, save_pretrained (from every rank, or from
    one given the full state dict) and the state dicts, generate(), a model built on the meta device reading
    this rank's parts from the saved folder, and load_weights into a model sharded already."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import AutoConfig, AutoModelForCausalLM

    from linnet.errors import UserError
    from linnet.torch import fully_shard

    out = {}
    model = case_model("llama", False)
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    loss = model(**batch(0, rank), use_cache=False).loss
    loss.backward()
    out["bf16"] = (model._linnet_engine.compute_dtype, float(loss), {p.grad.dtype for p in model.parameters()})

    model = case_model("qwen3", True)
    fully_shard(model)
    model.set_requires_gradient_sync(False)
    model(**batch(0, rank), use_cache=False).loss.backward()
    model.set_requires_gradient_sync(True)
    model(**batch(1, rank), use_cache=False).loss.backward()
    out["accumulated_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).full_tensor())
    torch.optim.SGD(model.parameters(), lr=0.1).step()

    model.save_pretrained(folder)
    full = model.state_dict()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    gathered = get_model_state_dict(model, options=options)  # every rank; the first keeps it
    model.save_pretrained(f"{folder}-given", state_dict=gathered, is_main_process=rank == 0)  # accelerate's save
    model.save_pretrained(f"{folder}-bf16", dtype=torch.bfloat16)
    try:
        model.save_pretrained(f"{folder}-parts", state_dict={"model.norm.weight": next(model.parameters())})
    except UserError as error:
        out["dtensor refused"] = str(error)
    if rank == 0:
        assert gathered.keys() == full.keys() and all(torch.equal(gathered[name], full[name]) for name in full)
        in_bf16 = AutoModelForCausalLM.from_pretrained(f"{folder}-bf16", dtype="auto")
        out["bf16 saved"] = (in_bf16.dtype, all(torch.equal(tensor, full[name].bfloat16())
                                                for name, tensor in in_bf16.state_dict().items()))
        for saved in (folder, f"{folder}-given"):
            loaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).state_dict()
            out[f"equal {saved}"] = loaded.keys() == full.keys() and all(torch.equal(loaded[k], full[k]) for k in full)
    out["loss_after"] = float(model(**batch(2, rank), use_cache=False).loss)
    # what transformers' Trainer does to every FSDPModule under accelerate's FSDP2: reshard(), and generate()
    # wrapped in FSDP2's forward hooks
    from torch.distributed.fsdp import register_fsdp_forward_method

    model.reshard()
    register_fsdp_forward_method(model, "generate")
    prompts = torch.randint(1, VOCAB, (2, 5 + rank), generator=torch.Generator().manual_seed(rank))
    mask = torch.ones_like(prompts)
    mask[1, :2] = 0  # left padding, as generation pads
    out["generated"] = (prompts, mask, model.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=4,
                                                      do_sample=False))

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    fully_shard(meta)
    out["meta_loss"] = float(meta(**batch(2, rank), use_cache=False).loss)
    again = case_model("qwen3", True)
    fully_shard(again)
    again.load_weights(folder)  # into a model sharded already, as resuming a Trainer run does
    out["reloaded_loss"] = float(again(**batch(2, rank), use_cache=False).loss)

    # a model loaded in bf16 keeps f32 parts: saved in f32 (as Trainer checkpoints are), they read back exactly
    def bf16_model():
        model = fully_shard(case_model("llama", True).to(torch.bfloat16))
        model(**batch(0, rank), use_cache=False).loss.backward()
        return model

    trained = bf16_model()
    torch.optim.SGD(trained.parameters(), lr=0.1).step()
    trained.save_pretrained(f"{folder}-f32", dtype=torch.float32)
    resumed = bf16_model()
    resumed.load_weights(f"{folder}-f32")
    out["f32 parts read back"] = all(torch.equal(a.to_local(), b.to_local()) and a.dtype == torch.float32
                                     for a, b in zip(trained.parameters(), resumed.parameters()))
    return out


def test_mixed_precision_accumulation_saving_and_the_meta_device(tmp_path):
    results = run(rest_of_the_api, 2, str(tmp_path / "saved"), timeout=LIMIT_S)
    reference = case_model("llama", False)
    for rank, result in enumerate(results):
        dtype, loss, gradient_dtypes = result["bf16"]
        assert dtype == torch.bfloat16 and gradient_dtypes == {torch.float32}
        expected = float(reference(**batch(0, rank), use_cache=False).loss)
        assert loss == pytest.approx(expected, rel=2e-2) and loss != expected  # computed in bf16: close, not equal
    # accumulated over two micro-batches: the gradient of their sum, averaged over the ranks
    model = case_model("qwen3", True)
    sum(model(**batch(step, rank), use_cache=False).loss for step in (0, 1) for rank in range(2)).div(2).backward()
    expected_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    assert [r["accumulated_norm"] for r in results] == pytest.approx([expected_norm] * 2, rel=1e-5)
    saved = str(tmp_path / "saved")
    assert results[0][f"equal {saved}"] and results[0][f"equal {saved}-given"]
    assert results[0]["bf16 saved"] == (torch.bfloat16, True)
    assert all(result["f32 parts read back"] for result in results)
    for result in results:
        assert "model.norm.weight as a DTensor" in result["dtensor refused"]
    for result in results:
        assert result["meta_loss"] == result["reloaded_loss"] == result["loss_after"]  # the same weights, read back
    # generate(), each rank its own prompts (one rank's sequences may end first), against transformers' own with
    # its key-value cache, from the saved weights
    from transformers import AutoModelForCausalLM

    alone = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    for prompts, mask, generated in (result["generated"] for result in results):
        expected = alone.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=4, do_sample=False)
        assert torch.equal(generated, expected)


def refusals(rank: int, world: int) -> dict:
    """What fully_shard refuses, each before the model changes: the message of each refusal."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
    from transformers import GPT2Config, GPT2LMHeadModel

    from linnet.torch import fully_shard

    def refused(make, **options) -> tuple[str, bool]:
        model = make()
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        try:
            fully_shard(model, **options)
        except (ValueError, TypeError) as error:
            after = dict(model.named_parameters())
            kept = before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
            return str(error), kept
        raise AssertionError(f"fully_shard took {type(model).__name__} with {options}")

    def with_adapters():
        model = case_model("llama", False)
        model.peft_config = {"default": None}
        return model

    def fsdp2_sharded():
        model = case_model("llama", False)
        return fsdp2_fully_shard(model, mesh=init_device_mesh("cpu", (world,)))

    tiny_gpt2 = GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2)
    return {
        "architecture": refused(lambda: GPT2LMHeadModel(tiny_gpt2)),
        "adapters": refused(with_adapters),
        "fsdp2": refused(fsdp2_sharded),
        "window": refused(lambda: make_hf_model("mistral", seed=0, num_key_value_heads=2, sliding_window=8)),
        "base model": refused(lambda: case_model("llama", False).model),
        "offload": refused(lambda: case_model("llama", False), offload_policy=CPUOffloadPolicy()),
        "tensor-parallel mesh": refused(lambda: case_model("llama", False),
                                        mesh=init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))),
    }


REFUSED = {  # each refusal names the thing and the way out
    "architecture": ["model_type 'gpt2' has no family", "supported: llama, mistral, qwen2, qwen3"],
    "adapters": ["PEFT adapters", "merge_and_unload"],
    "fsdp2": ["already sharded by PyTorch's FSDP"],
    "window": ["sliding_window"],
    "base model": ["…ForCausalLM", "LlamaModel"],
    "offload": ["does not offload", "CPUOffloadPolicy"],
    "tensor-parallel mesh": ["one dimension, or of two named ('replicate', 'shard')", "('dp', 'tp')"],
}


def test_what_fully_shard_does_not_compute_is_refused_in_one_line_before_the_model_changes():
    for what, (message, kept) in run(refusals, 2, timeout=LIMIT_S)[0].items():
        assert kept, f"{what}: the model changed before the refusal"
        assert "\n" not in message, f"{what}: {message}"
        for words in REFUSED[what]:
            assert words in message, f"{what}: {message}"


def checkpointing(rank: int, world: int) -> tuple:
    """Gradient checkpointing enabled before fully_shard, or after (as transformers' Trainer does), is
    recompute "full"; disabled, back to the policy fully_shard took; the losses are the same throughout."""
    from linnet.torch import fully_shard

    model = case_model("llama", True)
    model.gradient_checkpointing_enable()
    fully_shard(model)
    before = model._linnet_engine.sharding.recompute
    model = fully_shard(case_model("llama", True))
    policies, losses = [], []
    for change in (None, model.gradient_checkpointing_enable, model.gradient_checkpointing_disable):
        if change is not None:
            change()
        policies.append((model._linnet_engine.sharding.recompute, model.is_gradient_checkpointing))
        loss = model(**batch(0, rank), use_cache=False).loss
        loss.backward()
        losses.append(float(loss))
    return before, policies, losses, [float(p.grad.to_local().norm()) for p in model.parameters()]


def test_gradient_checkpointing_is_the_full_recompute_policy():
    before, policies, losses, _ = run(checkpointing, 2, timeout=LIMIT_S)[0]
    assert before == "full"
    assert policies == [("gather", False), ("full", True), ("gather", False)]
    assert losses[0] == losses[1] == losses[2]


def test_trls_sft_trainer_on_linnet_equals_trl_as_its_users_run_it(tmp_path):
    """tests/trl_driver.py over 2 Gloo processes, as TRL runs on CPUs (DistributedDataParallel) and on a model
    sharded by Linnet, on packed rows (TRL's padding-free collator): the logged loss, gradient norm, entropy and
    token accuracy of each step, and the saved weights, two micro-batches a step (on Linnet the first holds its
    gradients: accelerate's no_sync). TRL's defaults hold: its fused LM head's outputs, and gradient
    checkpointing. Then the Linnet run resumed from its checkpoint at step 2, started by `accelerate launch`
    from other weights: the same steps 3 and 4, the same weights."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[test]')")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(root / "tests"), str(root), os.environ.get("PYTHONPATH", "")])}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes=2",
                  "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no",
                  f"--main_process_port={free_port()}"]
    runs = {"ddp": (torchrun, "ddp"), "linnet": (torchrun, "linnet"),
            "resumed": (accelerate, "linnet", str(tmp_path / "linnet/run/checkpoint-2"))}
    results = {}
    for name, (launcher, *arguments) in runs.items():
        out = tmp_path / name
        done = subprocess.run([*launcher, str(root / "tests/trl_driver.py"), arguments[0], str(out), *arguments[1:]],
                              cwd=root, env=env, capture_output=True, text=True, timeout=LIMIT_S)
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
        results[name] = (json.loads((out / "history.json").read_text()), load_file(out / "final/model.safetensors"))
    (expected, expected_weights), (history, weights) = results["ddp"], results["linnet"]
    assert all(json.loads((tmp_path / name / "held.json").read_text()) for name in ("linnet", "resumed"))
    assert len(history) == len(expected) == 4
    for step, entry in zip(expected, history):
        assert entry == pytest.approx(step, rel=1e-5, abs=1e-7)
    assert weights.keys() == expected_weights.keys()
    for name, tensor in weights.items():
        assert relative_error(tensor.numpy(), expected_weights[name].numpy()) < 5e-5, name
    resumed_history, resumed_weights = results["resumed"]
    assert len(resumed_history) == 4  # steps 1-2 from the checkpoint's state, 3-4 run again
    for step, entry in zip(history, resumed_history):
        assert entry == pytest.approx(step, rel=1e-6)
    for name, tensor in weights.items():
        assert torch.equal(resumed_weights[name], tensor), name


def compiled_lengths(rank: int, world: int, lengths: list) -> tuple[list, int]:
    """(loss, gradient norm) at each length, compiled by inductor, and how many graphs dynamo made."""
    import torch._dynamo.utils

    from linnet.torch import fully_shard

    torch._dynamo.reset()  # (a pooled rank may have compiled before)
    torch._dynamo.utils.counters.clear()
    model = fully_shard(case_model("llama", True), compile="inductor")
    results = []
    for length in lengths:
        ids = torch.randint(1, VOCAB, (2, length), generator=torch.Generator().manual_seed(length))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((float(loss), float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).full_tensor())))
        model.zero_grad()
    return results, torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_compiled_batches_of_other_lengths_compile_once_more_and_train_as_transformers():
    """A Trainer's batches vary in length: compiled, the second length makes the length dynamic (dynamo's
    automatic dynamic shapes), and every later length runs that graph; each loss and gradient norm is
    transformers' own."""
    lengths = [20, 24, 33, 47]
    results, graphs = run(compiled_lengths, 1, lengths, timeout=600)[0]
    assert graphs == 2
    alone = case_model("llama", True)
    for length, (loss, norm) in zip(lengths, results):
        ids = torch.randint(1, VOCAB, (2, length), generator=torch.Generator().manual_seed(length))
        expected = alone(input_ids=ids, labels=ids).loss
        expected.backward()
        expected_norm = float(torch.nn.utils.clip_grad_norm_(alone.parameters(), 1e9))
        alone.zero_grad()
        assert (loss, norm) == pytest.approx((float(expected), expected_norm), rel=1e-5), length
