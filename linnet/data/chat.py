"""Fine-tuning rows as Examples, the loss on what the model should learn to write: the rows TRL and most
chat data sets hold, told apart by their fields.

    example(tokenizer, {"messages": [{"role": "user", "content": "2+2?"},
                                     {"role": "assistant", "content": "4"}]})
    example(tokenizer, {"prompt": "2+2=", "completion": "4"})
    example(tokenizer, {"instruction": "Add.", "input": "2+2", "output": "4"})

- `messages` (a conversation, one or many turns; TRL's conversational format): rendered by the
  tokenizer's chat template, the loss on every assistant turn's tokens and the end-of-turn token the
  template writes after each (not on the rest of the template's text, a reasoning block it adds included).
- `prompt` and `completion`, each a string (TRL's standard prompt-completion: plain text, the completion
  followed by the end-of-sequence token) or a list of messages (conversational: the prompt's turns, then
  the completion's assistant turns, as `messages`).
- alpaca's `instruction`, optional `input` and `output`: a user turn and the assistant's answer, as
  `messages`.

Where an assistant turn is found: the template renders the whole conversation once; each turn's content
is found in that text, in order, and the end of its turn is the first special token the template writes
after a content (learnt from a probe conversation). So a template may render turns differently by their
place (Qwen3 drops earlier turns' reasoning) and still be read; a content it rewrites is refused, by name."""

from __future__ import annotations

from collections.abc import Sequence

from linnet.data.packing import Example

__all__ = ["ROW_FORMATS", "check_row", "example", "messages_example", "text_example"]

ROW_FORMATS = ('a JSON object with "messages" (a list of {"role", "content"} turns), with "prompt" and "completion", '
               'or with the strings "instruction", "output" and, optionally, "input"')
ROLES = ("system", "user", "assistant", "tool", "developer")
MOST_TOKENS = 2048  # of an example; the rest of a longer one is cut


def check_row(row, where: str) -> dict:
    """The row, checked and normalised (alpaca's absent or null "input" is ""), or a ValueError that starts
    with `where` (a file and line) and says what is wrong."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a JSON {_kind(row)}, not a row: each line is {ROW_FORMATS}")
    if "messages" in row:
        _check_messages(row["messages"], f"{where}: 'messages'")
        return row
    if "prompt" in row or "completion" in row:
        missing = [field for field in ("prompt", "completion") if field not in row]
        if missing:
            raise ValueError(f"{where}: the row has no {missing[0]!r}: each line is {ROW_FORMATS}")
        if isinstance(row["prompt"], str) != isinstance(row["completion"], str):
            raise ValueError(f"{where}: 'prompt' and 'completion' are both strings or both lists of turns, "
                             f"got a {_kind(row['prompt'])} and a {_kind(row['completion'])}")
        if not isinstance(row["prompt"], str):
            _check_messages(row["prompt"], f"{where}: 'prompt'", needs_assistant=False)
            _check_messages(row["completion"], f"{where}: 'completion'")
        return row
    missing = [field for field in ("instruction", "output") if field not in row]
    if missing:
        raise ValueError(f"{where}: the row has no {' and no '.join(map(repr, missing))}: each line is {ROW_FORMATS}")
    if row.get("input") is None:
        row = {**row, "input": ""}
    for field in ("instruction", "input", "output"):
        if not isinstance(row[field], str):
            raise ValueError(f"{where}: {field!r} is {_json(row[field])}, not a string: each line is {ROW_FORMATS}")
    return row


def _check_messages(messages, where: str, needs_assistant: bool = True) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where} is {_json(messages)}: a list of turns, each {{\"role\": ..., \"content\": ...}}")
    for index, turn in enumerate(messages):
        if not isinstance(turn, dict) or not isinstance(turn.get("content"), str) or turn.get("role") not in ROLES:
            raise ValueError(f"{where}, turn {index + 1}, is {_json(turn)}: each turn is {{\"role\": one of "
                             f"{', '.join(ROLES)}, \"content\": a string}}")
    if needs_assistant and not any(turn["role"] == "assistant" for turn in messages):
        raise ValueError(f"{where} has no assistant turn: nothing to learn")


def example(tokenizer, row: dict, most_tokens: int = MOST_TOKENS) -> Example:
    """The row (checked by check_row) as an Example: its tokens, the loss on what the model should write."""
    if "messages" in row:
        return messages_example(tokenizer, row["messages"], most_tokens)
    if "prompt" in row:
        if isinstance(row["prompt"], str):
            return text_example(tokenizer, row["prompt"], row["completion"], most_tokens)
        return messages_example(tokenizer, [*row["prompt"], *row["completion"]], most_tokens)
    user = row["instruction"] + (f"\n\n{row['input']}" if row["input"] else "")
    return messages_example(tokenizer, [{"role": "user", "content": user},
                                        {"role": "assistant", "content": row["output"]}], most_tokens)


def text_example(tokenizer, prompt: str, completion: str, most_tokens: int = MOST_TOKENS) -> Example:
    """Plain text: the prompt's tokens (with the tokenizer's own special tokens, a bos), then the completion's
    and the end-of-sequence token, the loss on those last, as TRL's prompt-completion."""
    prompt_ids = tokenizer(prompt)["input_ids"]
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return Example.prompted(prompt_ids, completion_ids[: max(1, most_tokens - len(prompt_ids))])


def messages_example(tokenizer, messages: Sequence[dict], most_tokens: int = MOST_TOKENS) -> Example:
    """The conversation rendered by the tokenizer's chat template, the loss on each assistant turn's tokens
    and the end-of-turn token after it; cut to `most_tokens`."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    learnt = _assistant_spans(tokenizer, messages, text)
    # weights[t] weighs the prediction of token t + 1: learnt where that token reaches into an assistant span
    # (a token may hold the space before a content, as sentencepiece's do)
    weights = [float(any(offsets[t + 1][0] < end and offsets[t + 1][1] > start for start, end in learnt))
               for t in range(len(ids) - 1)]
    return Example(ids[:most_tokens], weights[: most_tokens - 1])


def _assistant_spans(tokenizer, messages: Sequence[dict], text: str) -> list[tuple[int, int]]:
    """[start, end) in `text` of each assistant turn's content and the end-of-turn token after it."""
    end_of_turn = _end_of_turn(tokenizer)
    spans, cursor = [], 0
    for index, turn in enumerate(messages):
        content = turn["content"].strip()
        found = text.find(content, cursor)
        if turn["role"] != "assistant":
            cursor = found + len(content) if found >= 0 else cursor
            continue
        if found < 0:
            raise ValueError(f"turn {index + 1} (assistant): the chat template rewrites its content, so its tokens "
                             f"cannot be found in the rendered conversation: {content[:60]!r}")
        end = found + len(content)
        closing = text.find(end_of_turn, end)
        if closing < 0 or text[end:closing].strip():
            raise ValueError(f"turn {index + 1} (assistant): the chat template writes no {end_of_turn!r} right after "
                             f"its content, as after the other turns")
        spans.append((found, closing + len(end_of_turn)))
        cursor = closing + len(end_of_turn)
    return spans


def _end_of_turn(tokenizer) -> str:
    """The special token the chat template writes right after an assistant turn's content."""
    probe = "Linnet probes the template."
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hello."},
                                          {"role": "assistant", "content": probe}], tokenize=False)
    if probe not in text:
        raise ValueError("the chat template rewrites an assistant turn's content (a probe turn is not in what it "
                         "renders), so the assistant's tokens cannot be found")
    after = text[text.rindex(probe) + len(probe):]
    specials = sorted((token for token in tokenizer.all_special_tokens + list(tokenizer.get_added_vocab())
                       if token and token in after), key=after.index)
    if not specials:
        raise ValueError(f"the chat template writes no special token after an assistant turn ({after!r}), so "
                         f"the model could not learn where its turns end")
    return specials[0]


def _kind(value) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "true or false",
            type(None): "null", dict: "object"}.get(type(value), type(value).__name__)


def _json(value) -> str:
    import json

    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 80 else text[:77] + "..."
