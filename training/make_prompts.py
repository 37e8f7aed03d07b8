"""Write the larger training prompt set for self-distilled heads.

The shipped `training/data/train_prompts.jsonl` (424 prompts) trains a head in minutes,
but its heads stop near 0.47 validation top-1 accuracy (depth 1); with this set's answers
added, an EAGLE-3 head reached 0.54. This writes `training/data/train_large_prompts.jsonl`:
topics x request templates plus programming tasks x code templates, 2,265 prompts,
deterministic (a fixed seed picks which topic meets which template). With --varied it
writes `train_varied_prompts.jsonl` instead: the same topics and tasks under 28 other
kinds of request (and code in Rust, C and scripts), 1,424 prompts.

Nothing here overlaps the held-out prompts (`heldout_prompts.jsonl`): their topics,
programming tasks and templates are all left out, so held-out acceptance still measures
prompts of a kind the head never saw (tests/speculators/test_prompts.py checks this).

    python -m training.make_prompts                 # writes the default path
    python -m training.make_prompts --varied        # writes train_varied_prompts.jsonl
    python -m scripts.train_eagle --eagle3 --unroll 3 --data training/data/train_large_prompts.jsonl ...
"""
from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
DEFAULT_OUT = DATA / "train_large_prompts.jsonl"
VARIED_OUT = DATA / "train_varied_prompts.jsonl"

HELDOUT_TEMPLATES = [  # every held-out prompt is one of these (tests/speculators/test_prompts.py checks it)
    r"Write a short story that involves (.+)\.",
    r"Tell me something surprising about (.+)\.",
    r"Describe (.+) in simple words\.",
    r"Show me Python code that (.+)\.",
]

TOPICS = [
    # science and nature
    "DNA", "antibiotics", "black holes", "coral reefs", "earthquakes", "glaciers", "gravity", "honey bees",
    "how vaccines work", "hurricanes", "octopuses", "photosynthesis", "plate tectonics", "rainbows",
    "the human heart", "the immune system", "the periodic table", "the water cycle", "volcanoes", "climate change",
    "electricity", "magnetism", "the speed of light", "evolution", "dinosaurs", "the solar system", "Mars",
    "comets", "the ozone layer", "rain forests", "wolves", "whales", "ants", "mushrooms", "bacteria", "the brain",
    "the human skeleton", "blood types", "allergies", "the seasons", "lightning", "sound waves", "magnets",
    "crystals", "the deep ocean", "sharks", "elephants", "butterflies", "bats", "the carbon cycle", "atoms",
    "stem cells", "genetics", "the Big Bang", "galaxies", "the Sun", "the Moon's phases", "snowflakes",
    "caves", "rivers", "wetlands", "soil", "pollination", "owls", "frogs", "the nervous system", "vitamins",
    # technology
    "airplanes", "electric cars", "machine learning", "quantum computing", "solar panels", "the internet",
    "smartphones", "batteries", "3D printing", "robots", "satellites", "GPS", "email", "search engines",
    "video games", "open source software", "cloud computing", "databases", "computer viruses", "passwords",
    "encryption", "wind turbines", "electric trains", "the steam engine", "the telephone", "radio", "television",
    "microchips", "self-driving cars", "drones", "virtual reality", "programming languages", "the Linux kernel",
    "spreadsheets", "nuclear power", "bridges", "skyscrapers", "refrigerators", "the light bulb",
    # history and society
    "democracy", "the French Revolution", "the Great Wall of China", "the Olympic Games", "the Roman Empire",
    "the Silk Road", "the moon landing", "the printing press", "ancient Egypt", "the pyramids", "the Vikings",
    "the Industrial Revolution", "the Cold War", "the Middle Ages", "ancient Greece", "the Aztecs",
    "the United Nations", "the Magna Carta", "world maps", "the alphabet", "money", "taxes", "public libraries",
    "the metric system", "the stock market", "inflation", "compound interest", "banks", "trade", "cities",
    "voting", "human rights", "museums", "newspapers", "universities", "the postal service", "calendars",
    # everyday life and culture
    "bread baking", "chess", "coffee", "jazz music", "meditation", "recycling", "renewable energy", "sleep",
    "the Amazon rainforest", "gardening", "cooking pasta", "running", "swimming", "yoga", "football",
    "basketball", "the piano", "photography", "painting", "poetry", "libraries", "learning a new language",
    "time management", "friendship", "healthy eating", "drinking water", "public transport", "camping",
    "chocolate", "cheese", "rice", "spices", "origami", "knitting", "board games", "dogs",
    "cats", "houseplants", "composting", "saving money", "job interviews", "public speaking", "teamwork",
    "volunteering", "mountains", "islands", "the Arctic", "hiking", "cycling", "opera", "theatre",
]

TEMPLATES = [
    "Write a short paragraph about {}.",
    "Explain {} to a ten-year-old.",
    "Give me a brief history of {}.",
    "Summarize the main ideas behind {} in a few sentences.",
    "What are three interesting facts about {}?",
    "Why is {} important?",
    "What are the pros and cons of {}?",
    "Write a haiku about {}.",
    "Write a short poem about {}.",
    "How does {} work? Answer in a few sentences.",
    "List five key points about {}.",
    "What are common misconceptions about {}?",
    "Write the opening of a blog post about {}.",
    "Write a short dialogue between a teacher and a student about {}.",
    "Give me three questions for a quiz about {}, with answers.",
    "What should a beginner know about {}?",
    "Write a fable that teaches a lesson using {}.",
    "Explain {} as if I were a university student.",
]

CODE_TASKS = [
    "parses a date string into year, month and day", "computes the greatest common divisor",
    "flattens a nested list", "reverses a string", "reads a text file and counts its lines",
    "converts Celsius to Fahrenheit", "sorts a list of dictionaries by a key", "checks whether a number is prime",
    "groups words by their first letter", "computes the factorial of n", "implements binary search",
    "returns the n-th Fibonacci number", "validates an email address with a regular expression",
    "finds the largest element in a list", "transposes a matrix", "merges two sorted lists",
    "removes duplicates from a list while keeping order", "checks whether a string is a palindrome",
    "counts the words in a sentence", "computes the mean and median of a list",
    "counts how often each character appears in a string", "converts a Roman numeral to an integer",
    "converts an integer to binary", "checks whether brackets in a string are balanced",
    "finds the longest word in a sentence", "computes the dot product of two vectors",
    "multiplies two matrices", "returns the prime factors of a number", "checks whether a year is a leap year",
    "splits a list into chunks of size n", "computes the moving average of a list",
    "reads a CSV file into a list of dictionaries", "writes a dictionary to a JSON file",
    "counts vowels in a string", "finds the intersection of two lists", "implements bubble sort",
    "implements quicksort", "implements merge sort", "computes the power set of a list",
    "generates all permutations of a string", "finds the missing number in a list from 1 to n",
    "computes the sum of digits of a number",
    "checks whether a number is an Armstrong number", "returns the n-th row of Pascal's triangle",
    "computes the edit distance between two strings", "finds the most common element in a list",
    "converts minutes into hours and minutes", "validates a password's strength",
    "removes punctuation from a string", "computes compound interest", "implements a stack class",
    "implements a queue with two stacks", "reverses a linked list", "computes the depth of a binary tree",
    "checks whether a graph has a cycle", "performs a breadth-first search on a graph",
    "computes the area of a circle", "computes the distance between two points",
    "formats a number with thousands separators", "shuffles a list without random.shuffle",
    "counts the lines, words and characters of a file", "checks whether two dictionaries are equal ignoring order",
    "caches the results of a slow function",
    "retries a function call up to three times", "measures how long a function takes",
]

CODE_TEMPLATES = [
    "Write a Python function that {}.",
    "Write a Python function that {}, with a docstring and an example.",
    "Write a JavaScript function that {}.",
    "Explain how to write a Python function that {}, then write it.",
    "Write a Python function that {} and a few unit tests for it.",
]

# --varied: other kinds of request over the same topics and tasks (none a paraphrase of a
# held-out template), for heads that must not learn a handful of templates: an EAGLE-3
# head trained on the templates above accepted 3.15 tokens a step on its training answers,
# 2.65 on unseen prompts of the same templates, 2.13 on the held-out ones
VARIED_TEMPLATES = [
    "Write a limerick about {}.",
    "Write a headline and a short news article about {}.",
    "Write a letter to a friend explaining what you learned about {}.",
    "What would the world be like without {}?",
    "Give me a step-by-step guide to getting started with {}.",
    "Give me an analogy that explains {}.",
    "Write a short speech about {} for a school assembly.",
    "Write a tweet about {}.",
    "Give me an outline for a ten-minute presentation on {}.",
    "Write an FAQ with three questions and answers about {}.",
    "Compare {} with something from everyday life.",
    "What are the biggest open questions about {} today?",
    "Write a motivational message inspired by {}.",
    "How might {} change in the next fifty years?",
    "Write an advertisement for a museum exhibition about {}.",
    "Define {} in one sentence, then explain the definition.",
    "What jobs are connected to {}?",
    "Write a diary entry by someone learning about {} for the first time.",
    "Pretend you are a tour guide and talk to visitors about {}.",
    "Explain {} using only short sentences.",
    "Give me a mnemonic to remember key facts about {}.",
    "Write a few lines of a song about {}.",
    "Give arguments for and against spending public money on {}.",
    "Write the first paragraph of an encyclopedia entry on {}.",
    "What mistakes do people often make when they talk about {}?",
    "Write a riddle whose answer is {}, then explain it.",
    "Interview an expert about {}: write three questions and their answers.",
    "Write a thank-you note to the people who work on {}.",
]

VARIED_CODE_TEMPLATES = [
    "Write a Rust function that {}.",
    "Write a C function that {}, with a short main that calls it.",
    "Write a Python script that {}, and explain each part of it.",
    "Write type-annotated Python code that {}, and show its output on an example.",
]


def heldout_subjects() -> set[str]:
    """The topics and programming tasks of the held-out prompts (what their templates fill in)."""
    subjects = set()
    for line in (DATA / "heldout_prompts.jsonl").read_text().splitlines():
        text = json.loads(line)["messages"][-1]["content"]
        match = next(filter(None, (re.fullmatch(t, text) for t in HELDOUT_TEMPLATES)), None)
        if match is None:
            raise ValueError(f"held-out prompt of an unknown template: {text!r}")
        subjects.add(match.group(1))
    return subjects


def mentions_heldout(text: str, subjects: set[str]) -> bool:
    """Whether a prompt uses a held-out template or names a held-out subject (any case, with
    or without a leading "the", singular or plural)."""
    stems = {subject.removeprefix("the ").removesuffix("s") for subject in subjects}
    return (any(re.fullmatch(t, text) for t in HELDOUT_TEMPLATES)
            or any(re.search(rf"\b{re.escape(stem)}s?\b", text, re.IGNORECASE) for stem in stems))


def prompts(templates_per_topic: int, seed: int, varied: bool = False) -> list[str]:
    """Every topic meets `templates_per_topic` templates (chosen by the seed); every
    programming task meets every code template (the varied ones with `varied`)."""
    templates, code_templates = (VARIED_TEMPLATES, VARIED_CODE_TEMPLATES) if varied else (TEMPLATES, CODE_TEMPLATES)
    rng = random.Random(seed)
    out = []
    for topic in TOPICS:
        out += [t.format(topic) for t in rng.sample(templates, templates_per_topic)]
    out += [t.format(task) for task in CODE_TASKS for t in code_templates]
    rng.shuffle(out)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--varied", action="store_true",
                   help=f"the varied templates, written to {VARIED_OUT.name} by default (6 per topic)")
    p.add_argument("--out", default=None, help=f"JSONL to write (default: {DEFAULT_OUT})")
    p.add_argument("--templates-per-topic", type=int, default=None, help="default: 10 (--varied: 6)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if len(set(TOPICS)) != len(TOPICS) or len(set(CODE_TASKS)) != len(CODE_TASKS):
        raise SystemExit("a topic or task is listed twice")
    if set(TEMPLATES) & set(VARIED_TEMPLATES):
        raise SystemExit("a template is both a plain and a varied one")
    args.out = args.out or str(VARIED_OUT if args.varied else DEFAULT_OUT)
    per_topic = args.templates_per_topic or (6 if args.varied else 10)
    lines = prompts(per_topic, args.seed, args.varied)
    with open(args.out, "w") as f:
        for text in lines:
            f.write(json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n")
    print(f"{len(lines)} prompts -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
