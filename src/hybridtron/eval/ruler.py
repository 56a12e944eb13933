"""RULER-style long-context evaluation: synthetic tasks sized in the model's tokens, scored as RULER scores them.

RULER (Hsieh et al. 2024, NVIDIA/RULER) asks a model to find and aggregate what was hidden in a long context, at
lengths chosen by the evaluator, so accuracy against length shows how much of its context window a model can use
(RULER calls a length "effective" where the score stays above 85.6). The tasks, as RULER's `synthetic.yaml`:

    niah_single_1/2/3   one needle "One of the special magic {numbers|uuids} for {key} is: {value}." in noise /
                        real text / real text, the value a 7-digit number / a number / a uuid
    niah_multikey_1     4 needles with different keys in real text, one asked about
    niah_multikey_2/3   the haystack is itself needles (distractors with other keys); keys words / uuids
    niah_multivalue     4 values for one key, all asked
    niah_multiquery     4 keys, all asked
    vt                  variable tracking in noise: "VAR ABCDE = 12345", then 4 hops "VAR FGHIJ = VAR ABCDE"; answer:
                        every variable holding the value (one worked example first, as RULER)
    cwe                 common words: a numbered list where 10 words appear 30 times and the rest 3 (6 and 1 below
                        4K, as RULER), after a small worked example; answer: the 10 common words
    fwe                 frequent words: coded 6-letter words drawn with Zipf counts (alpha 2, the top rank is
                        "..." noise); answer: the next three ranks

Keys are adjective-noun words or uuids. Needles go in at depths drawn from 40 evenly spaced points over 0-100% (in
sorted order, so a chain keeps its order), each on a line of its own. Noise is RULER's filler paragraph; real text
is the embedded corpus (`Haystack.stdlib()`: the running Python's standard library, documents in path order, a
sample starting at a document its seed picks); cwe's words are the distinct words of that text.

Sizes count tokens of the model's tokenizer as the model reads them: the bos token, then `tokenizer.encode(prompt)`.
As in RULER a length is the prompt plus the task's answer budget (its `tokens_to_generate`: 128 for niah, 30 vt,
120 cwe, 50 fwe); the haystack is searched for the most units (filler sentences, words of real text, distractor
needles, listed words) whose prompt fits, so a prompt is at most `length - answer_budget` tokens and short of it by
less than one unit or SIZE_SLACK (0.1%). `needle_spans` are [start, end) positions in that token sequence (bos = 0).

Scoring (RULER's `string_match_all`, used by every task here): per sample, the share of reference strings found in
the prediction, case-insensitively, mean over samples, x100; `string_match_part` (any reference found) is RULER's
QA scorer. Every sample is deterministic for (task, length, seed, index); decoding is greedy through the engine.

Departures from RULER: the real-text haystack is Python source, not Paul Graham's essays, and needles go at line
breaks (RULER: sentence breaks); keys and cwe's words come from an embedded list and the corpus, not wonderwords;
prompts keep RULER's structure (instruction, context, question, answer prefix) in their own words and use the base
template (no chat template); qa_1/qa_2 need SQuAD / HotpotQA downloads and are left out.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
import re
import string
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from pathlib import Path

from hybridtron.data.stdlib import stdlib_files
from hybridtron.data.tokenizer import Tokenizer
from hybridtron.eval.progress import Progress
from hybridtron.infer.engine import HybridEngine
from hybridtron.infer.sampling import SamplingParams


@dataclass(frozen=True)
class TaskSpec:
    kind: str  # "niah", "vt", "cwe" or "fwe"
    haystack: str = "noise"  # where needles hide: "noise", "text" (real text) or "needles" (distractor needles)
    key_type: str = "words"  # "words" (adjective-noun) or "uuids"
    value_type: str = "numbers"  # "numbers" (7 digits) or "uuids"
    keys: int = 1  # needles with distinct keys
    values: int = 1  # values (needles) per key
    queries: int = 1  # keys asked about
    answer_budget: int = 128  # tokens generated; part of the length
    scoring: str = "string_match_all"


TASKS = {
    "niah_single_1": TaskSpec("niah"),
    "niah_single_2": TaskSpec("niah", "text"),
    "niah_single_3": TaskSpec("niah", "text", value_type="uuids"),
    "niah_multikey_1": TaskSpec("niah", "text", keys=4),
    "niah_multikey_2": TaskSpec("niah", "needles"),
    "niah_multikey_3": TaskSpec("niah", "needles", key_type="uuids", value_type="uuids"),
    "niah_multivalue": TaskSpec("niah", "text", values=4),
    "niah_multiquery": TaskSpec("niah", "text", keys=4, queries=4),
    "vt": TaskSpec("vt", answer_budget=30),
    "cwe": TaskSpec("cwe", "text", answer_budget=120),
    "fwe": TaskSpec("fwe", answer_budget=50),
}
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
DEPTHS = [round(100 * i / 39) / 100 for i in range(40)]  # RULER's 40 insertion depths, 0% to 100%
ADJECTIVES = ("amber ancient bitter brave bright calm clever cold crimson curious dark eager early elegant empty "
              "fierce fragile gentle golden graceful hidden hollow humble icy jolly kind lazy little lively lone "
              "loud lucky mellow misty narrow noble odd pale proud quiet rapid rare rough rustic silent silver "
              "sleepy smooth solemn stormy swift tender tidy vivid wild").split()
NOUNS = ("anchor apple arrow badger banner basket beacon bell blossom bridge candle canyon castle cedar cloud "
         "comet cottage crystal desert dragon drum eagle ember falcon feather forest fountain garden glacier "
         "harbor helmet island jacket kettle ladder lantern meadow mirror monkey needle orchard otter pebble "
         "pepper pillow planet quarry river saddle tiger tulip violin wagon walnut").split()
WORD = re.compile(r"\b[a-z]{4,10}\b")  # cwe's pool: lowercase words of the haystack text
TEXT_UNIT = re.compile(r"\s*\S+")  # a word of real text with the whitespace before it: units join back to the text
CWE_COMMON = 10
FWE_ALPHA_ZETA = math.pi ** 2 / 6  # zeta(2): fwe's Zipf counts with alpha 2 sum to the words drawn
SIZE_SLACK = 0.001  # a prompt may fall short of its target by this share (or by less than one haystack unit)


def task_spec(task: str) -> TaskSpec:
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; expected some of {', '.join(TASKS)}")
    return TASKS[task]


def check_length(task: str, length: int, max_positions: int) -> None:
    """ValueError unless the model's positions hold `length` (the prompt plus the task's answer budget)."""
    budget = task_spec(task).answer_budget
    if length > max_positions:
        raise ValueError(f"{task} at length {length}: the model holds {max_positions} positions "
                         f"(max_position_embeddings), a prompt of at most {max_positions - budget} tokens with the "
                         f"{budget}-token answer budget; ask for a length of at most {max_positions}")


class Haystack:
    """Real text for the needles: documents read in order. A sample starts at a document its seed picks and reads
    on, wrapping around once; `Haystack.stdlib()` is the embedded corpus."""

    def __init__(self, documents: Sequence[str], name: str = "haystack"):
        self.documents = [document for document in documents if document.strip()]
        self.name = name
        if not self.documents:
            raise ValueError(f"haystack {name}: no text")

    @classmethod
    def stdlib(cls, families: tuple[str, ...] | None = None) -> Haystack:
        return cls([file.text for file in stdlib_files(families)], "stdlib")

    @cached_property
    def words(self) -> list[str]:
        """cwe's word pool: the distinct lowercase words of 4 to 10 letters in the text, sorted."""
        return sorted({word for document in self.documents for word in WORD.findall(document)})

    def units(self, start: int, chars: int) -> tuple[list[str], bool]:
        """The text from document `start` on (documents apart by a line break) until about `chars` characters, as
        words with their leading whitespace; and whether that is all of the text."""
        pieces, total = [], 0
        for step in range(len(self.documents)):
            document = self.documents[(start + step) % len(self.documents)]
            pieces.append(document.rstrip("\n") + "\n")
            total += len(pieces[-1])
            if total >= chars:
                break
        units = TEXT_UNIT.findall("".join(pieces))
        if not units[0].startswith("\n"):  # every line of the context starts with a line break (see render_lines)
            units[0] = "\n" + units[0].lstrip()
        return units, len(pieces) == len(self.documents)


@dataclass
class RulerSample:
    task: str
    length: int  # requested: prompt tokens + answer budget <= length
    index: int
    seed: int
    prompt: str  # what the model reads after its bos token
    references: list[str]
    scoring: str
    needle_spans: list[tuple[int, int]]  # [start, end) token positions of each needle in [bos] + encode(prompt)
    prompt_tokens: int  # len([bos] + encode(prompt))
    answer_budget: int
    prediction: str | None = None  # filled in by run_ruler
    score: float | None = None  # this sample's score, 0-100


@dataclass
class Layout:
    """A sample being sized: `render(n)` is the prompt with n haystack units and the needles' character spans."""

    render: Callable[[int], tuple[str, list[tuple[int, int]]]]
    available: int  # the most units render may take
    references: list[str]
    more_source: bool = False  # more real text can be read when the available units do not fill the prompt


# ================================================================================================ generating
def draw(rng: random.Random, kind: str) -> str:
    """A random key or value: "numbers" (7 digits), "uuids", "words" (adjective-noun), "letters" (vt's variable
    names, 5 uppercase) or "coded" (fwe's words, 6 lowercase)."""
    if kind == "numbers":
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if kind == "letters":
        return "".join(rng.choices(string.ascii_uppercase, k=5))
    if kind == "coded":
        return "".join(rng.choices(string.ascii_lowercase, k=6))
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def distinct(rng: random.Random, kind: str, count: int) -> list[str]:
    drawn: list[str] = []
    while len(drawn) < count:
        drawn += [value for value in [draw(rng, kind)] if value not in drawn]
    return drawn


def english_list(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", and " + items[-1]


def noise_units(count: int) -> list[str]:
    """RULER's filler paragraph repeated, one sentence a unit; each paragraph starts a line."""
    return [("\n" if i % len(NOISE) == 0 else " ") + NOISE[i % len(NOISE)] for i in range(count)]


def line_starts(units: list[str]) -> list[int]:
    """The units that start a line (a line break in their leading whitespace): where a needle may go."""
    return [i for i, unit in enumerate(units) if "\n" in unit[:len(unit) - len(unit.lstrip())]]


def render_lines(head: str, tail: str, units: list[str], starts: list[int], needles: list[str],
                 depths: list[float], n: int) -> tuple[str, list[tuple[int, int]]]:
    """head + the first n units with each needle on a line of its own at the first line start at or after its
    depth (sorted depths keep the needles' order) + tail; and the needles' character spans."""
    pieces, spans, offset, done = [head], [], len(head), 0
    for needle, depth in zip(needles, depths):
        found = bisect.bisect_left(starts, round(depth * n))
        at = min(starts[found] if found < len(starts) else n, n)
        pieces.append("".join(units[done:at]))
        offset += len(pieces[-1])
        spans.append((offset + 1, offset + 1 + len(needle)))
        pieces.append("\n" + needle)
        offset += 1 + len(needle)
        done = at
    pieces += ["".join(units[done:n]), tail]
    return "".join(pieces), spans


def niah_layout(spec: TaskSpec, rng: random.Random, target: int, haystack: Haystack | None, chars: int) -> Layout:
    keys = distinct(rng, spec.key_type, spec.keys)
    values = [[draw(rng, spec.value_type) for _ in range(spec.values)] for _ in keys]
    kind = spec.value_type
    needles = [NEEDLE.format(kind=kind, key=key, value=value) for key, row in zip(keys, values) for value in row]
    rng.shuffle(needles)
    depths = sorted(rng.sample(DEPTHS, len(needles)))
    asked = rng.sample(range(len(keys)), spec.queries)
    query = english_list([keys[i] for i in asked])
    one = spec.values * spec.queries == 1  # RULER's singular wording for a single answer
    noun, verb, it = (kind[:-1], "is", "it") if one else (kind, "are", "them")
    head = (f"{'A special magic ' + noun + ' is' if one else 'Special magic ' + noun + ' are'} hidden in the text "
            f"below. Memorize {it}: you will be asked about the {noun} afterwards.")
    tail = (f"\nWhich special magic {noun} for {query} {verb} mentioned in the text above? The special magic {noun} "
            f"for {query} mentioned in the text above {verb}")
    more = False  # only real text has more to read
    if spec.haystack == "noise":
        units = noise_units(target)
    elif spec.haystack == "needles":  # a distractor needle is well over 4 tokens in any tokenizer
        others = [draw(rng, spec.key_type) for _ in range(target // 4)]
        units = ["\n" + NEEDLE.format(kind=kind, key=key, value=draw(rng, kind)) for key in others if key not in keys]
    else:
        units, whole = haystack.units(rng.randrange(len(haystack.documents)), chars)
        more = not whole
    starts = line_starts(units)
    return Layout(lambda n: render_lines(head, tail, units, starts, needles, depths, n), len(units),
                  [value for i in asked for value in values[i]], more_source=more)


def vt_layout(rng: random.Random, target: int, hops: int = 4) -> Layout:
    def chain() -> tuple[list[str], list[str], str]:
        names = distinct(rng, "letters", hops + 1)
        value = str(rng.randint(10000, 99999))
        chain = [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in itertools.pairwise(names)]
        return names, chain, value

    def head_tail(value: str) -> tuple[str, str]:
        return ("Memorize and track the chain of variable assignments hidden in the text below.\n",
                (f"\nQuestion: Which variables are assigned the value {value} in the text above? Answer: Following "
                 f"the chain of assignments in the text above, {hops + 1} variables are assigned the value {value}, "
                 f"they are:"))

    units = noise_units(target)
    starts = line_starts(units)
    example_names, example_chain, example_value = chain()  # one worked example, as RULER's vt prompt has
    example_depths = sorted(rng.sample(DEPTHS, len(example_chain)))
    example, _ = render_lines(*head_tail(example_value), units, starts, example_chain, example_depths, 3 * len(NOISE))
    example += " " + " ".join(example_names) + "\n\n"
    names, statements, value = chain()
    depths = sorted(rng.sample(DEPTHS, len(statements)))
    head, tail = head_tail(value)
    return Layout(lambda n: render_lines(example + head, tail, units, starts, statements, depths, n), len(units),
                  names)


def cwe_layout(rng: random.Random, length: int, haystack: Haystack, key: str) -> Layout:
    words = list(haystack.words)
    rng.shuffle(words)
    long_context = length >= 4096  # RULER repeats less, with a smaller example, below 4K
    common_repeats, rare_repeats = (30, 3) if long_context else (6, 1)
    head = ("Below is a numbered list of words, some of which appear more often than others. Memorize the ones that "
            "appear most often.\n")
    tail = (f"\nQuestion: Which {CWE_COMMON} words appear most often in the list above? Answer: The {CWE_COMMON} "
            f"words that appear most often in the list are:")

    def listing(chosen: list[str], repeats: tuple[int, int], order: str) -> str:
        entries = chosen[:CWE_COMMON] * repeats[0] + chosen[CWE_COMMON:] * repeats[1]
        random.Random(order).shuffle(entries)
        return " ".join(f"{i + 1}. {word}" for i, word in enumerate(entries))

    shown = 40 if long_context else 20
    example_words = words[-shown:]
    example = (head + listing(example_words, (10, 3) if long_context else (3, 1), key + ":example") + tail + " " +
               " ".join(f"{i + 1}. {word}" for i, word in enumerate(example_words[:CWE_COMMON])) + "\n")

    def render(n: int) -> tuple[str, list[tuple[int, int]]]:
        return example + head + listing(words[:CWE_COMMON + n], (common_repeats, rare_repeats), key) + tail, []

    return Layout(render, max(len(words) - shown - CWE_COMMON, 0), words[:CWE_COMMON])


def fwe_layout(rng: random.Random, target: int, key: str) -> Layout:
    vocab_size = max(target // 50, 5)  # RULER: one coded word per 50 tokens of prompt
    vocab = distinct(rng, "coded", vocab_size)
    vocab[0] = "..."  # the most frequent rank is noise the question says to ignore
    head = ("Read the coded text below and count how often each coded word appears. Find the three most frequent "
            "coded words. ")
    tail = ("\nQuestion: Do not explain. Ignore the dots '...'. Which three words appear most often in the coded "
            "text above? Answer: According to the coded text above, the three most frequent words are:")

    def render(n: int) -> tuple[str, list[tuple[int, int]]]:
        drawn = [word for rank, word in enumerate(vocab, 1) for _ in range(int(n / rank ** 2 / FWE_ALPHA_ZETA))]
        random.Random(key).shuffle(drawn)
        return head + " ".join(drawn) + tail, []

    return Layout(render, 2 * target, vocab[1:4])


def largest_fitting(fits: Callable[[int], bool], guess: int, upper: int) -> int:
    """The largest n in [0, upper] with fits(n) (fits(0) holds): gallop from a close guess to a bracket, bisect it."""
    low, high = 0, upper + 1
    n, step = min(max(guess, 1), upper), 1
    while high - low > 1 and low < n < high:
        if fits(n):
            low, n = n, n + step
        else:
            high, n = n, n - step
        step *= 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def fit_prompt(tokenizer: Tokenizer, layout: Layout, target: int) -> tuple | None:
    """(units, text, needle character spans, encoding) of the prompt with the most haystack units whose tokens, bos
    included, fit in `target`; None when the prompt does not fit even without haystack."""
    best, measured = None, {}

    def measure(n: int) -> int:
        nonlocal best
        if n not in measured:
            text, spans = layout.render(n)
            encoding = tokenizer.backend.encode(text, add_special_tokens=False)
            measured[n] = 1 + len(encoding.ids)  # 1: the bos token
            if measured[n] <= target and (best is None or n > best[0]):
                best = (n, text, spans, encoding)
        return measured[n]

    bare = measure(0)
    if bare > target or layout.available == 0:
        return best
    # The prompt grows about linearly with its units: a few secant steps from a probe land within a unit or two of
    # the answer, which galloping and bisection then pin down. Each step encodes the whole prompt (0.5 s at 128K
    # tokens on one core), so a prompt within SIZE_SLACK of the target is taken as it is.
    previous, n = 0, min(layout.available, 256)
    for _ in range(6):
        if 0 <= target - measure(n) <= target * SIZE_SLACK:
            return best
        slope = max((measure(n) - measure(previous)) / (n - previous), 1e-3)  # tokens a unit, lately
        guess = min(max(int(n + (target - measure(n)) / slope), 0), layout.available)
        if guess in (n, previous):
            break
        previous, n = n, guess
    largest_fitting(lambda k: measure(k) <= target, n, layout.available)
    return best


def generate_sample(task: str, tokenizer: Tokenizer, length: int, *, seed: int = 0, index: int = 0,
                    haystack: Haystack | None = None) -> RulerSample:
    """Sample `index` of `task` at `length` tokens (prompt + answer budget), sized in `tokenizer`'s tokens.
    `haystack`: the real text of the text tasks and cwe (default: `Haystack.stdlib()`; pass one to reuse it)."""
    spec = task_spec(task)
    target = length - spec.answer_budget
    if spec.haystack == "text" and haystack is None:
        haystack = Haystack.stdlib()
    key = f"ruler:{task}:{length}:{seed}:{index}"
    chars = 8 * target + 4096  # characters of real text read: doubled while they cannot fill the prompt
    while True:
        rng = random.Random(key)
        if spec.kind == "niah":
            layout = niah_layout(spec, rng, target, haystack, chars)
        elif spec.kind == "vt":
            layout = vt_layout(rng, target)
        elif spec.kind == "cwe":
            layout = cwe_layout(rng, length, haystack, key)
        else:
            layout = fwe_layout(rng, target, key)
        fitted = fit_prompt(tokenizer, layout, target)
        if fitted is None:
            bare = 1 + len(tokenizer.encode(layout.render(0)[0]))
            raise ValueError(f"{task} at length {length}: the prompt without haystack (instructions, needles or "
                             f"listed words, question) takes {bare} tokens, more than the {target} a prompt may hold "
                             f"(the length minus the {spec.answer_budget}-token answer budget); ask for a longer "
                             f"length")
        n, text, spans, encoding = fitted
        if n < layout.available:
            break
        if not layout.more_source:
            source = haystack.name if haystack is not None else spec.haystack
            raise ValueError(f"{task} at length {length}: the haystack source {source!r} is too short: all of it "
                             f"makes a prompt of {1 + len(encoding.ids)} tokens, the length needs {target} (the "
                             f"length minus the {spec.answer_budget}-token answer budget)")
        chars *= 2
    starts, ends = [start for start, _ in encoding.offsets], [end for _, end in encoding.offsets]
    token_spans = [(1 + bisect.bisect_right(ends, start), 1 + bisect.bisect_left(starts, end)) for start, end in spans]
    return RulerSample(task, length, index, seed, text, layout.references, spec.scoring, token_spans,
                       1 + len(encoding.ids), spec.answer_budget)


def prompt_ids(tokenizer: Tokenizer, sample: RulerSample) -> list[int]:
    """The tokens the model reads: bos, then the prompt (what `needle_spans` index)."""
    return [tokenizer.bos_id] + tokenizer.encode(sample.prompt)


# ================================================================================================== scoring
def string_match_all(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's niah/vt/cwe/fwe score: mean over samples of the share of references found (case-insensitive), x100."""
    found = [sum(r.lower() in p.lower() for r in refs) / len(refs) for p, refs in zip(predictions, references)]
    return round(100 * sum(found) / len(found), 2)


def string_match_part(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's QA score: share of samples whose prediction holds any reference (case-insensitive), x100."""
    found = [any(r.lower() in p.lower() for r in refs) for p, refs in zip(predictions, references)]
    return round(100 * sum(found) / len(found), 2)


SCORERS = {"string_match_all": string_match_all, "string_match_part": string_match_part}


def clean_prediction(text: str) -> str:
    """As RULER reads a prediction: control characters become line breaks, outer whitespace goes."""
    return re.sub(r"[\x00-\x1f]", "\n", text.strip()).strip()


# ================================================================================================== running
@dataclass
class RulerResult:
    tasks: list[str]
    lengths: list[int]
    scores: dict[str, dict[int, float]]  # task -> length -> score, 0-100
    average: dict[int, float]  # length -> mean score over the tasks
    samples: list[RulerSample]  # with their predictions and scores
    seconds: float

    def table(self) -> str:
        width = max(len(name) for name in [*self.tasks, "average"])
        lines = [f"{'task':<{width}}" + "".join(f"{length_label(n):>9}" for n in self.lengths)]
        for name, row in [*self.scores.items(), ("average", self.average)]:
            lines.append(f"{name:<{width}}" + "".join(f"{row[n]:>9.2f}" for n in self.lengths))
        return "\n".join(lines)

    def to_dict(self, prompts: bool = False) -> dict:
        """JSON-ready (json writes the int length keys as strings); prompts are left out unless asked."""
        out = asdict(self)
        if not prompts:
            for sample in out["samples"]:
                del sample["prompt"]
        return out


def length_label(length: int) -> str:
    return f"{length // 1024}K" if length % 1024 == 0 else str(length)


def run_ruler(engine: HybridEngine, tasks: Sequence[str], lengths: Sequence[int], *, samples: int = 10,
              seed: int = 0, haystack: Haystack | None = None, progress: bool = False) -> RulerResult:
    """Each task at each length: `samples` prompts generated for the engine's tokenizer, decoded greedily through the
    engine (batched over its slots: size them with its max_slots or memory_budget_gib) and scored as RULER.
    `progress`: a progress line on stderr (`hybridtron.eval.progress`)."""
    started = time.perf_counter()
    if samples < 1 or not tasks or not lengths:
        raise ValueError(f"run_ruler: expected tasks, lengths and samples >= 1, got {list(tasks)}, {list(lengths)}, "
                         f"{samples}")
    for task in tasks:
        for length in lengths:
            check_length(task, length, engine.max_context)
    if haystack is None and any(task_spec(task).haystack == "text" for task in tasks):
        haystack = Haystack.stdlib()
    tokenizer, scored, scores = engine.tokenizer, [], {}
    # a length a task cannot be laid out at is refused before anything is decoded: each pair's first sample (a
    # tenth of a second), kept for the batch
    first = {(task, length): generate_sample(task, tokenizer, length, seed=seed, index=0, haystack=haystack)
             for task in tasks for length in lengths}
    # a sample's prefill and attention cost about its length: the estimate weighs samples by it
    line = Progress("eval ruler", samples * len(tasks) * len(lengths), "samples",
                    work=samples * len(tasks) * sum(lengths), enabled=progress)
    for task in tasks:
        spec = task_spec(task)
        for length in lengths:
            batch = [first[task, length]] + [generate_sample(task, tokenizer, length, seed=seed, index=i,
                                                             haystack=haystack) for i in range(1, samples)]
            params = SamplingParams(temperature=0.0, max_tokens=spec.answer_budget, seed=seed)
            completions = engine.generate([prompt_ids(tokenizer, s) for s in batch], params, logprobs=False)
            # the end token that stopped a completion is no part of its text
            outputs = [c.token_ids[:-1] if c.token_ids[-1:] and c.token_ids[-1] in engine.end_token_ids
                       else c.token_ids for (c,) in completions]
            predictions = [clean_prediction(tokenizer.decode(tokens)) for tokens in outputs]
            score = SCORERS[spec.scoring]
            scores.setdefault(task, {})[length] = score(predictions, [s.references for s in batch])
            scored += [replace(s, prediction=p, score=score([p], [s.references])) for s, p in zip(batch, predictions)]
            line.advance(samples, work=samples * length, note=f"{task} at {length_label(length)}")
    average = {n: round(sum(scores[t][n] for t in tasks) / len(tasks), 2) for n in lengths}
    return RulerResult(list(tasks), list(lengths), scores, average, scored, time.perf_counter() - started)


def plot_ruler(result: RulerResult, path: str | Path, title: str = "RULER-style accuracy by context length") -> Path:
    """Accuracy against length, one line per task and a bold average, with RULER's 85.6 threshold; a PNG."""
    import matplotlib  # optional dependency: only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 4.8), dpi=100)
    for task in result.tasks:
        axes.plot(result.lengths, [result.scores[task][n] for n in result.lengths], marker="o", linewidth=1, label=task)
    axes.plot(result.lengths, [result.average[n] for n in result.lengths], color="black", linewidth=2.5,
              marker="s", label="average")
    axes.axhline(85.6, color="grey", linestyle=":", label="RULER's effective-length bar (85.6)")
    if len(result.lengths) > 1:
        axes.set_xscale("log", base=2)
    axes.set_xticks(result.lengths, [length_label(n) for n in result.lengths])
    axes.set_ylim(-3, 103)
    axes.set(xlabel="context length (tokens)", ylabel="score (0-100)", title=title)
    axes.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path)
    plt.close(figure)
    return path
