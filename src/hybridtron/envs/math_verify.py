"""Math answers: extraction and comparison by exact value. Standard library only: it runs in the grading
child (`python -I -S math_verify.py --serve`, see `grading.py`) as well as in-process.

Extraction: only the text after the last `</think>` counts (a completion whose thinking never closes has no
answer); in it, the content of the last `\\boxed{...}` (braces balanced), else the last "Answer: ..." line.

Comparison: both sides become a `fractions.Fraction`, so 0.5, 1/2, \\frac{1}{2}, \\dfrac12 and $\\frac{2}{4}$
agree while 0.333 and 1/3 do not. Accepted: integers with or without thousands separators (1,234 or 1 234
or LaTeX's 1{,}234; groups of three digits only, so "1,2" is not a number), decimals, a/b, \\frac/\\dfrac/
\\tfrac, a leading sign (also U+2212), `$...$`, `\\(...\\)`, `\\[...\\]`, `\\text{...}`, outer braces or
parentheses, a trailing period and a leading "x =". Anything else (units, percent, expressions) scores 0:
the environments ask for a bare number.
"""

import json
import re
import sys
from fractions import Fraction

MAX_ANSWER_CHARS = 200  # no answer an environment asks for is longer; bounds every parse below

_ANSWER_LINE = re.compile(r"^[ \t*_]*(?:final[ \t]+)?answer[ \t*_]*[:\uff1a][ \t*_]*(.*?)[ \t*_]*$",
                          re.IGNORECASE | re.MULTILINE)
_NUMBER = re.compile(r"(\d{1,3}(?:,\d{3})+|\d{1,3}(?: \d{3})+|\d+)?(?:\.(\d+))?")
_WRAPPERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
_TEXT_COMMAND = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{")
_NOISE = ("\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\ ", "~")


def final_text(completion: str) -> str:
    """The answer part of a completion (the tags are data.tokenizer's THINK_START/THINK_END, spelt out here
    because this module runs in a child that imports nothing of hybridtron)."""
    if "</think>" in completion:
        return completion.rsplit("</think>", 1)[1]
    return "" if "<think>" in completion else completion


def _group_end(text: str, start: int) -> int:
    """Index just past the brace group opening at `start`, or -1 when it never closes."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    return -1


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}); None if there is none or it never closes."""
    starts = [m for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    if not starts:
        return None
    brace = starts[-1].end() - 1
    end = _group_end(text, brace)
    return None if end < 0 else text[brace + 1:end - 1]


def extract_answer(completion: str) -> str | None:
    text = final_text(completion)
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    lines = _ANSWER_LINE.findall(text)
    return lines[-1] if lines else None


def _strip_once(s: str) -> str:
    s = s.strip()
    for left, right in _WRAPPERS:
        if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
            return s[len(left):len(s) - len(right)]
    m = _TEXT_COMMAND.match(s)
    if m and _group_end(s, m.end() - 1) == len(s):
        return s[m.end():-1]
    if s.startswith("{") and _group_end(s, 0) == len(s):
        return s[1:-1]
    if s.startswith("(") and s.endswith(")") and s.count("(") == 1 and s.count(")") == 1:
        return s[1:-1]
    if s.endswith(".") and not s.endswith(".."):
        return s[:-1]
    m = re.match(r"[A-Za-z]\w*\s*=\s*(.+)$", s, re.DOTALL)
    if m:
        return m.group(1)
    return s


def normalize(s: str) -> str:
    s = s.replace("\u2212", "-").replace("\u2009", " ").replace("\u202f", " ").replace("\u00a0", " ")
    s = s.replace("{,}", ",").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for noise in _NOISE:
        s = s.replace(noise, " " if noise in ("\\ ", "~") else "")
    while True:
        stripped = _strip_once(s)
        if stripped == s:
            return s.strip()
        s = stripped


def _parse_number(s: str) -> Fraction | None:
    s = s.strip()
    sign = 1
    if s[:1] in ("-", "+"):
        sign = -1 if s[0] == "-" else 1
        s = s[1:].strip()
    m = _NUMBER.fullmatch(s)
    if not s or not m or (m.group(1) is None and m.group(2) is None):
        return None
    whole = (m.group(1) or "0").replace(",", "").replace(" ", "")
    return sign * Fraction(f"{whole}.{m.group(2) or '0'}")


def _frac_argument(s: str, i: int) -> tuple[str, int] | None:
    """One argument of \\frac: a brace group or a single character (\\frac12)."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        return None
    if s[i] == "{":
        end = _group_end(s, i)
        return None if end < 0 else (s[i + 1:end - 1], end)
    return s[i], i + 1


def parse_value(text: str) -> Fraction | None:
    """The exact value of an answer string, or None if it is not a number in an accepted form."""
    if len(text) > MAX_ANSWER_CHARS:
        return None
    s = normalize(text)
    sign = 1
    if s[:1] in ("-", "+") and s[1:].lstrip().startswith("\\frac"):
        sign, s = (-1 if s[0] == "-" else 1), s[1:].lstrip()
    try:
        if s.startswith("\\frac"):
            numerator = _frac_argument(s, len("\\frac"))
            denominator = numerator and _frac_argument(s, numerator[1])
            if not denominator or s[denominator[1]:].strip():
                return None
            top, bottom = parse_value(numerator[0]), parse_value(denominator[0])
            return None if top is None or not bottom else sign * top / bottom
        if s.count("/") == 1:
            top, bottom = (_parse_number(part) for part in s.split("/"))
            return None if top is None or not bottom else top / bottom
        return _parse_number(s)
    except (ValueError, ZeroDivisionError):  # e.g. past Python's limit on digits in an int
        return None


def grade(completion: str, answer: str) -> float:
    """1.0 when the completion's final answer has the value of `answer` (the environment's key), else 0.0."""
    expected = parse_value(answer)
    if expected is None:
        raise ValueError(f"the answer key {answer!r} is not a number this verifier reads")
    got = extract_answer(completion)
    return 1.0 if got is not None and parse_value(got) == expected else 0.0


def serve(memory_mb: int) -> None:
    """The grading child: one JSON `[completion, answer]` per line in, one line out ("1", "0" or "E why")."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20,) * 2)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    for line in stdin:
        try:
            completion, answer = json.loads(line)
            reply = b"1\n" if grade(completion, answer) == 1.0 else b"0\n"
        except Exception as e:  # noqa: BLE001 - reported to the parent, which counts it
            reply = ("E " + f"{type(e).__name__}: {e}".replace("\n", " ")[:300] + "\n").encode()
        stdout.write(reply)
        stdout.flush()


if __name__ == "__main__":
    if sys.argv[1:2] != ["--serve"]:
        raise SystemExit("usage: python -I -S math_verify.py --serve MEMORY_MB")
    serve(int(sys.argv[2]))
