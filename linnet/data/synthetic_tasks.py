"""Synthetic instruction rows for smoke-testing fine-tuning offline.

`generate` makes alpaca-format rows ({"instruction", "input", "output"}) from
eight simple task kinds, each answerable from the prompt alone, so that even a
tiny model trained for a few dozen steps shows its loss fall. Everything is
made here from small built-in word and fact tables; nothing is downloaded.
"""

import random

WORDS = (
    "apple", "river", "stone", "cloud", "tiger", "lamp", "bread", "chair",
    "garden", "pencil", "window", "rabbit", "candle", "forest", "button",
    "kettle", "mirror", "pocket", "ladder", "violin", "onion", "cable",
    "rocket", "basket", "tunnel", "pepper", "island", "wagon", "spoon",
    "feather", "anchor", "blanket", "dragon", "engine", "falcon", "jacket",
    "magnet", "needle", "orange", "planet",
)

# Things with one obvious colour, written as they read mid-sentence.
COLOURS = (
    ("a banana", "yellow"), ("grass", "green"), ("the sky", "blue"),
    ("snow", "white"), ("coal", "black"), ("a strawberry", "red"),
    ("a carrot", "orange"), ("a lemon", "yellow"), ("a tomato", "red"),
    ("a frog", "green"), ("milk", "white"), ("a crow", "black"),
    ("the sea", "blue"), ("a plum", "purple"), ("chocolate", "brown"),
    ("a pumpkin", "orange"),
)


def _reverse_words(rng):
    words = rng.sample(WORDS, rng.randint(3, 6))
    instruction = rng.choice((
        "Reverse the order of these words.",
        "Write these words in reverse order.",
        "List the words backwards.",
    ))
    return instruction, " ".join(words), " ".join(reversed(words))


def _sort_numbers(rng):
    numbers = [rng.randint(0, 99) for _ in range(rng.randint(3, 6))]
    instruction = rng.choice((
        "Sort these numbers from smallest to largest.",
        "Put these numbers in ascending order.",
        "Arrange the numbers in increasing order.",
    ))
    return instruction, " ".join(map(str, numbers)), " ".join(map(str, sorted(numbers)))


def _add(rng):
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    instruction = rng.choice((
        f"What is {a} + {b}?",
        f"Add {a} and {b}.",
        f"Compute the sum of {a} and {b}.",
    ))
    return instruction, "", str(a + b)


def _uppercase(rng):
    word = rng.choice(WORDS)
    instruction = rng.choice((
        "Write this word in capital letters.",
        "Convert the word to uppercase.",
        "Spell the word in upper case.",
    ))
    return instruction, word, word.upper()


def _repeat(rng):
    word, times = rng.choice(WORDS), rng.randint(2, 5)
    instruction = rng.choice((
        f'Repeat the word "{word}" {times} times.',
        f"Say {word} {times} times.",
        f"Write {word} {times} times, separated by spaces.",
    ))
    return instruction, "", " ".join([word] * times)


def _larger(rng):
    a, b = rng.sample(range(100), 2)
    instruction = rng.choice((
        "Which number is larger?",
        "Name the bigger of the two numbers.",
        "Which of these is greater?",
    ))
    return instruction, f"{a} or {b}", str(max(a, b))


def _count(rng):
    items = rng.sample(WORDS, rng.randint(2, 7))
    instruction = rng.choice((
        "How many items are in this list?",
        "Count the words in the list.",
        "How many things are listed?",
    ))
    return instruction, ", ".join(items), str(len(items))


def _colour(rng):
    thing, colour = rng.choice(COLOURS)
    question = rng.choice((
        f"What colour is {thing}?",
        f"Tell me the colour of {thing}.",
        f"Name the colour of {thing}.",
    ))
    # Half the rows put the question in the input, so both layouts occur.
    if rng.random() < 0.5:
        return question, "", colour
    return "Answer the question in one word.", question, colour


KINDS = (_reverse_words, _sort_numbers, _add, _uppercase, _repeat, _larger, _count, _colour)


def generate(count: int, seed: int = 0) -> list[dict]:
    """Return `count` rows; the same (count, seed) always gives the same rows."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        instruction, input_, output = rng.choice(KINDS)(rng)
        rows.append({"instruction": instruction, "input": input_, "output": output})
    return rows


def messages(row: dict) -> list[dict]:
    """The chat a row stands for: the user asks (instruction, then input), the assistant answers."""
    content = row["instruction"] if not row["input"] else f"{row['instruction']}\n\n{row['input']}"
    return [{"role": "user", "content": content}, {"role": "assistant", "content": row["output"]}]
