"""Fine-tuning rows as Examples (linnet.data.chat): the loss falls on exactly the assistant's turns and the
end-of-turn token after each, for chat `messages`, prompt/completion and alpaca rows, read from a JSON-lines
file or a `datasets` folder; a row that is not one of them is named by file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from linnet import nest
from linnet.data import chat
from linnet.errors import UserError
from linnet.recipes import sft

pytestmark = pytest.mark.quick

CONVERSATION = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 5?"},
    {"role": "assistant", "content": "It is 8."},
]


@pytest.fixture(scope="module")
def tokenizer():
    return nest.tokenizer("tiny-llama")


def learnt(tokenizer, example) -> list[str]:
    """The runs of tokens the loss falls on, decoded: weights[t] weighs the prediction of token t + 1."""
    runs, run = [], []
    for t, weight in enumerate(example.weights):
        if weight:
            run.append(example.tokens[t + 1])
        elif run:
            runs.append(run)
            run = []
    if run:
        runs.append(run)
    return [tokenizer.decode(ids) for ids in runs]


def test_every_assistant_turn_and_its_end_token_is_learnt_and_nothing_else(tokenizer):
    example = chat.example(tokenizer, {"messages": CONVERSATION})
    assert learnt(tokenizer, example) == ["4<|eot_id|>", "It is 8.<|eot_id|>"]
    rendered = tokenizer(tokenizer.apply_chat_template(CONVERSATION, tokenize=False), add_special_tokens=False)
    assert list(example.tokens) == rendered["input_ids"]  # the template's tokens, as it writes them


def test_an_alpaca_row_is_a_user_turn_and_the_answer(tokenizer):
    row = chat.check_row({"instruction": "Add.", "input": "2 + 2", "output": "4"}, "data.jsonl:1")
    assert chat.example(tokenizer, row) == chat.example(tokenizer, {"messages": [
        {"role": "user", "content": "Add.\n\n2 + 2"}, {"role": "assistant", "content": "4"}]})


def test_a_prompt_and_completion_of_text_learn_the_completion_and_the_end_of_sequence(tokenizer):
    example = chat.example(tokenizer, {"prompt": "2 + 2 =", "completion": " 4"})
    assert learnt(tokenizer, example) == [" 4" + tokenizer.eos_token]
    assert example.tokens[0] == tokenizer.bos_token_id


def test_a_prompt_and_completion_of_turns_are_one_conversation(tokenizer):
    row = {"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:]}
    assert chat.example(tokenizer, row) == chat.example(tokenizer, {"messages": CONVERSATION})


def test_a_long_conversation_is_cut(tokenizer):
    whole = chat.example(tokenizer, {"messages": CONVERSATION})
    cut = chat.example(tokenizer, {"messages": CONVERSATION}, most_tokens=len(whole) - 3)
    assert (cut.tokens, cut.weights) == (whole.tokens[:-3], whole.weights[:-3])


def test_a_template_that_rewrites_an_answer_is_named_with_the_row(tokenizer):
    class Rewriting:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def __call__(self, *args, **kwargs):
            return tokenizer(*args, **kwargs)

        def apply_chat_template(self, messages, **kwargs):
            return tokenizer.apply_chat_template([{**m, "content": m["content"].upper()} for m in messages], **kwargs)

    with pytest.raises(UserError, match=r"^a row of --data \(\{\"messages\": .*\): the chat template rewrites an "
                                        r"assistant turn's content"):
        sft.example_maker(Rewriting())({"messages": CONVERSATION})


@pytest.mark.parametrize("row, message", [
    (["a"], "data.jsonl:3: a JSON list, not a row"),
    ({"messages": []}, "data.jsonl:3: 'messages' is []: a list of turns"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "data.jsonl:3: 'messages' has no assistant turn"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, "data.jsonl:3: 'messages', turn 1, is "),
    ({"messages": [{"role": "assistant", "content": 4}]}, "data.jsonl:3: 'messages', turn 1, is "),
    ({"prompt": "2 + 2"}, "data.jsonl:3: the row has no 'completion'"),
    ({"prompt": "2 + 2", "completion": [{"role": "assistant", "content": "4"}]},
     "data.jsonl:3: 'prompt' and 'completion' are both strings or both lists of turns, got a string and a list"),
    ({"instruction": "x"}, "data.jsonl:3: the row has no 'output'"),
])
def test_a_row_of_no_known_format_is_named(row, message):
    with pytest.raises(ValueError) as raised:
        chat.check_row(row, "data.jsonl:3")
    assert str(raised.value).startswith(message), str(raised.value)


def test_rows_of_every_format_are_read_from_a_file_and_a_saved_data_set(tmp_path):
    from datasets import Dataset

    rows = [{"messages": CONVERSATION}, {"prompt": "2 + 2 =", "completion": " 4"},
            {"instruction": "Add.", "output": "4"}]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert sft.read_rows(path) == [rows[0], rows[1], {**rows[2], "input": ""}]
    Dataset.from_list([{"messages": CONVERSATION}] * 3).save_to_disk(str(tmp_path / "saved"))
    assert sft.read_rows(tmp_path / "saved") == [{"messages": CONVERSATION}] * 3
    Dataset.from_list([{"messages": [{"role": "user", "content": "hi"}]}]).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(UserError, match=f"^{tmp_path / 'bad'} row 1: 'messages' has no assistant turn"):
        sft.read_rows(tmp_path / "bad")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="is a folder, but not a data set that datasets' save_to_disk wrote"):
        sft.read_rows(tmp_path / "empty")


# Each shipped family's chat template (tests/chat_templates) over a tiny byte-level tokenizer with the
# family's special tokens: (template, bos, end of turn, other special tokens).
FAMILIES = {
    "llama-3": ("llama3.jinja", "<|begin_of_text|>", "<|eot_id|>",
                ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>", "<|end_of_text|>"]),
    "qwen3": ("qwen3.jinja", None, "<|im_end|>", ["<|im_start|>", "<|endoftext|>", "<think>", "</think>"]),
    "qwen2.5": ("qwen25.jinja", None, "<|im_end|>", ["<|im_start|>", "<|endoftext|>"]),
    "mistral": ("mistral.jinja", "<s>", "</s>", ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]"]),
}


def family_tokenizer(family: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    template, bos, end_of_turn, others = FAMILIES[family]
    specials = [token for token in (bos, end_of_turn, *others) if token]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    text = [turn["content"] for turn in CONVERSATION] * 20 + ["system user assistant Today Date Cutting Knowledge"]
    tokenizer.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    chat_template = (Path(__file__).parent / "chat_templates" / template).read_text()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos, eos_token=end_of_turn,
                                   chat_template=chat_template)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_familys_template_weighs_exactly_the_assistant_turns_and_their_end_tokens(family):
    tokenizer = family_tokenizer(family)
    end_of_turn = FAMILIES[family][2]
    example = chat.example(tokenizer, {"messages": CONVERSATION})
    runs = learnt(tokenizer, example)
    assert [run.lstrip(" ") for run in runs] == ["4" + end_of_turn, "It is 8." + end_of_turn], runs
    assert all(run[: len(run) - len(run.lstrip(" "))] in ("", " ") for run in runs)  # at most the space before
    rendered = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert tokenizer.decode(example.tokens) == rendered
