"""Write train-draft prompts of MT-bench's eight kinds of request, from templates written here (not from MT-bench).

Why: a head trained on ShareGPT agrees with SmolLM2 0.70 of the time on held-out ShareGPT answers but 0.60 on
MT-bench answers (benchmarks/results/real_accept_h100.md): MT-bench's instruction-style requests (writing, roleplay,
reasoning, math, coding, extraction, STEM, humanities) lead the target into states ShareGPT rarely reaches, and
requests the 135M target wrote itself were too muddled to help (train_draft_smollm2_h100_selfprompts/). These are
clean requests of those kinds, crossed from hand-written templates and topics with a fixed seed. MT-bench stays the
evaluation set: a prompt sharing any six consecutive words with an MT-bench question is dropped.

    python scripts/instruct_prompts.py --out instruct.jsonl [--count 6000] [--seed 0]
    cat prompts.jsonl instruct.jsonl > mixed.jsonl   # with scripts/sharegpt_prompts.py's output
"""

from __future__ import annotations

import argparse
import json
import os
import random

MT_BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "mt_bench_questions.jsonl")

TOPICS = ["renewable energy", "remote work", "urban gardening", "the history of jazz", "volcanoes", "coral reefs",
          "electric cars", "ancient Rome", "the printing press", "honeybees", "public libraries", "chess",
          "the human immune system", "space telescopes", "minimalism", "street food", "climate adaptation",
          "the Silk Road", "machine translation", "sleep", "mountain hiking", "recycling plastics", "the stock market",
          "volunteering", "board games", "ocean tides", "coffee farming", "the Renaissance", "bicycles in cities",
          "learning a second language", "photography", "desert ecosystems", "museums", "public transport",
          "the invention of the telephone", "friendship", "time management", "vaccines", "bread baking", "glaciers"]
AUDIENCES = ["a ten-year-old", "a busy manager", "a first-year university student", "a retired teacher",
             "a skeptical investor", "a group of high-school students", "a new employee", "a curious tourist"]
FORMS = ["a short story", "a persuasive essay", "a blog post", "a poem", "a product description", "a speech",
         "a diary entry", "a news article", "a letter to the editor", "a limerick", "a dialogue between two friends",
         "a press release", "a cover letter", "a short review", "an advertisement", "a fable with a moral"]
PERSONAS = ["a pirate captain", "a medieval knight", "a detective in 1920s London", "a friendly robot",
            "a park ranger", "a chef at a busy restaurant", "an astronaut on the moon", "a librarian",
            "a fitness coach", "a museum guide", "a wizard's apprentice", "a travel agent", "a ship's doctor",
            "a grumpy cat", "a startup founder", "a history professor"]
SITUATIONS = ["a customer asks for a refund", "someone asks for directions to the nearest town",
              "a student asks for advice before an exam", "a friend is nervous about a job interview",
              "a visitor wants a recommendation for dinner", "someone asks what you did yesterday",
              "a child asks why the sky is blue", "a colleague asks for feedback on a plan"]
CONCEPTS = ["photosynthesis", "inflation", "entropy", "natural selection", "compound interest", "plate tectonics",
            "the Doppler effect", "supply and demand", "neural networks", "the water cycle", "black holes",
            "antibiotic resistance", "quantum entanglement", "opportunity cost", "the greenhouse effect",
            "DNA replication", "public-key cryptography", "Newton's laws of motion", "osmosis", "game theory"]
EVENTS = ["the Industrial Revolution", "the fall of the Berlin Wall", "the invention of the internet",
          "the Black Death", "the moon landing", "the French Revolution", "the spread of printing",
          "the abolition of slavery", "the rise of social media", "the Green Revolution in agriculture"]
DOMAINS = ["art", "politics", "daily life", "education", "the economy", "science", "religion", "family life"]
CODE_TASKS = ["reverses the words in a sentence", "checks whether a string is a palindrome",
              "returns the n-th Fibonacci number", "merges two sorted lists", "counts the vowels in a text",
              "finds the second largest number in a list", "removes duplicates from a list while keeping order",
              "converts a Roman numeral to an integer", "checks whether two strings are anagrams",
              "flattens a nested list", "returns the most common word in a text", "computes the GCD of two numbers",
              "validates an email address", "rotates a matrix by 90 degrees", "finds all primes below n",
              "parses a CSV line into fields", "computes a running average", "groups words by their first letter"]
LANGUAGES = ["Python", "JavaScript", "C++", "Java", "Go", "Rust"]
NAMES = ["Alice", "Ben", "Carla", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi", "Luca"]
ITEMS = ["apples", "books", "stamps", "marbles", "tickets", "pencils", "cookies", "shells"]


def _writing(r: random.Random) -> str:
    return r.choice([
        f"Write {r.choice(FORMS)} about {r.choice(TOPICS)}.",
        f"Write {r.choice(FORMS)} about {r.choice(TOPICS)} for {r.choice(AUDIENCES)}.",
        f"Draft an email to {r.choice(AUDIENCES)} explaining why {r.choice(TOPICS)} matters.",
        f"Rewrite this sentence to sound more formal: \"{r.choice(NAMES)} thinks {r.choice(TOPICS)} is kind of cool.\"",
        f"Give me five catchy titles for an article about {r.choice(TOPICS)}.",
        f"Write a 200-word summary of the main arguments for and against {r.choice(TOPICS)}.",
    ])


def _roleplay(r: random.Random) -> str:
    persona, situation = r.choice(PERSONAS), r.choice(SITUATIONS)
    return r.choice([
        f"Pretend you are {persona}. Stay in character: {situation}. How do you respond?",
        f"Act as {persona} and introduce yourself to {r.choice(AUDIENCES)}.",
        f"You are {persona}. Describe a typical day in your life.",
        f"Imagine you are {persona} giving advice about {r.choice(TOPICS)}. What do you say?",
    ])


def _reasoning(r: random.Random) -> str:
    a, b, c = r.sample(NAMES, 3)
    n, m = r.randint(3, 12), r.randint(2, 9)
    return r.choice([
        f"{a} is taller than {b}, and {b} is taller than {c}. Who is the shortest? Explain your reasoning.",
        f"{a} has {2 * (n + m)} {r.choice(ITEMS)} and gives {b} {m} fewer than half of them. How many does {b} "
        f"get? Think step by step.",  # {b} gets n: a whole, positive answer
        f"If every {r.choice(ITEMS)[:-1]} in a box is either red or blue, and there are {n} more red ones than blue "
        f"ones out of {n + 2 * m}, how many are blue?",  # blue = m: a whole answer
        f"{a}, {b} and {c} each own a different pet: a cat, a dog and a parrot. {a} does not own the dog, and {c} "
        f"owns the parrot. Who owns which pet?",
        f"A train leaves at {r.randint(1, 11)}:{r.choice(['00', '15', '30', '45'])} and the trip takes {n} hours "
        f"and {m * 5} minutes. When does it arrive? Explain.",
    ])


def _math(r: random.Random) -> str:
    a, b, c = r.randint(2, 15), r.randint(1, 40), r.randint(41, 200)
    return r.choice([
        f"Solve for x: {a}x + {b} = {c}. Show your steps.",
        f"What is the area of a triangle with base {a} cm and height {b} cm?",
        f"Find the sum of all integers from 1 to {c}.",
        f"A shop sells a jacket for ${c}. It is discounted by {a * 5}%. What is the new price?",
        f"What is the probability of rolling a total of {r.randint(3, 11)} with two fair dice?",
        f"Simplify the expression ({a}x^2 + {b}x) / x for x not equal to zero.",
        f"If f(x) = {a}x^2 - {b}x + 3, what is f({r.randint(1, 5)})?",
        f"What is the least common multiple of {a} and {b + 1}?",
    ])


def _coding(r: random.Random) -> str:
    task, lang = r.choice(CODE_TASKS), r.choice(LANGUAGES)
    return r.choice([
        f"Write a {lang} function that {task}.",
        f"Write a {lang} function that {task}, and explain its time complexity.",
        f"Here is a task: a function that {task}. Write it in {lang} with a few test cases.",
        f"What is a common bug when writing a function that {task}? Show a fixed version in {lang}.",
    ])


def _extraction(r: random.Random) -> str:
    a, b = r.sample(NAMES, 2)
    city = r.choice(["Lisbon", "Nairobi", "Osaka", "Toronto", "Krakow", "Lima", "Hanoi", "Perth"])
    year, amount = r.randint(1990, 2024), r.randint(2, 90)
    text = (f"In {year}, {a} moved to {city} and opened a small shop selling {r.choice(ITEMS)}. Two years later "
            f"{b} joined as a partner, and by then the shop employed {amount} people.")
    return r.choice([
        f"Extract every person's name, city and year from this text, as JSON: \"{text}\"",
        f"From the following passage, list the key facts as bullet points: \"{text}\"",
        f"Read this and answer: how many people did the shop employ, and who joined as a partner? \"{text}\"",
        f"Turn this text into a table with the columns name, role and year: \"{text}\"",
    ])


def _stem(r: random.Random) -> str:
    concept = r.choice(CONCEPTS)
    return r.choice([
        f"Explain {concept} in simple terms.",
        f"Explain {concept} to {r.choice(AUDIENCES)}, with an everyday example.",
        f"What are the most common misconceptions about {concept}?",
        f"How would you design a simple experiment or demonstration of {concept}?",
        f"Compare {concept} with {r.choice(CONCEPTS)}: how are they related?",
    ])


def _humanities(r: random.Random) -> str:
    event = r.choice(EVENTS)
    return r.choice([
        f"Discuss the impact of {event} on {r.choice(DOMAINS)}.",
        f"What were the main causes of {event}?",
        f"Compare how {event} changed {r.choice(DOMAINS)} and {r.choice(DOMAINS)}.",
        f"Which lessons from {event} still matter today? Give three examples.",
        f"Summarise the main debates among historians about {event}.",
    ])


KINDS = (_writing, _roleplay, _reasoning, _math, _coding, _extraction, _stem, _humanities)


def _six_grams(text: str) -> set[tuple[str, ...]]:
    words = text.lower().split()
    return {tuple(words[i:i + 6]) for i in range(len(words) - 5)}


def mt_bench_six_grams(path: str = MT_BENCH) -> set[tuple[str, ...]]:
    """Every six-word run of the MT-bench questions (both turns), or none where the file is absent."""
    grams: set[tuple[str, ...]] = set()
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                for turn in json.loads(line).get("turns", []):
                    grams |= _six_grams(turn)
    return grams


def instruct_prompts(count: int, seed: int = 0, banned: set[tuple[str, ...]] = frozenset()) -> list[str]:
    """Up to count distinct prompts, the eight kinds in turn (a kind whose templates run dry, 500 repeats in a row,
    drops out), none sharing a six-word run with `banned`."""
    r = random.Random(seed)
    prompts: list[str] = []
    seen: set[str] = set()
    kinds, misses, turn = list(KINDS), 0, 0
    while len(prompts) < count and kinds:
        kind = kinds[turn % len(kinds)]
        prompt = kind(r)
        if prompt in seen or _six_grams(prompt) & banned:
            misses += 1
            if misses == 500:
                kinds.remove(kind)
                misses = 0
            continue
        seen.add(prompt)
        prompts.append(prompt)
        misses, turn = 0, turn + 1
    return prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--count", type=int, default=6000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    banned = mt_bench_six_grams()
    prompts = instruct_prompts(args.count, args.seed, banned)
    with open(args.out, "w") as f:
        for prompt in prompts:
            f.write(json.dumps({"prompt": prompt}) + "\n")
    print(f"{len(prompts)} prompts -> {args.out} (MT-bench six-word runs checked: {len(banned)})")


if __name__ == "__main__":
    main()
