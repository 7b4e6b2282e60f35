"""Countdown reward (TinyZero semantics), pure Python: no torch, no eval, no exceptions.

The model's completion is untrusted text. It is never executed: the answer is tokenised by a linear
scan and evaluated by an iterative shunting-yard parser over exact fractions, with hard caps on the
expression's size, so any string is scored in time and memory linear in its length.

Format policy (why: see the README, "Reward"). The prompt ends with the assistant turn prefilled with
`<think>`, so a well-formed completion is

    ... reasoning ... </think> <answer> EQUATION </answer>

i.e. a `</think>`, then exactly one `<answer>...</answer>` block, with nothing but whitespace after it,
and no other `<answer>`/`</answer>` tag anywhere. Anything else (no answer, two answers, tag spam, an
answer before `</think>`, text after `</answer>`) scores 0. A well-formed completion whose equation is
wrong or invalid scores `format_score`; one that uses every given number exactly once and equals the
target exactly scores `score`.
"""

from __future__ import annotations

from fractions import Fraction

THINK_CLOSE = "</think>"
ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"

# An equation for 3-6 numbers has at most ~25 tokens; these caps bound the work on hostile input.
MAX_EXPRESSION_TOKENS = 256
MAX_LITERAL_DIGITS = 18

_OPERATORS = {"+": 1, "-": 1, "*": 2, "/": 2}


def extract_answer(completion: str) -> str | None:
    """The equation inside the completion's single, final answer block, or None if not well-formed."""
    think_end = completion.rfind(THINK_CLOSE)
    if think_end < 0:
        return None
    if completion.count(ANSWER_OPEN) != 1 or completion.count(ANSWER_CLOSE) != 1:
        return None
    start = completion.find(ANSWER_OPEN)
    end = completion.find(ANSWER_CLOSE)
    if not (think_end + len(THINK_CLOSE) <= start < end):
        return None
    if completion[end + len(ANSWER_CLOSE):].strip():
        return None
    return completion[start + len(ANSWER_OPEN):end].strip()


def _tokenize(expr: str) -> list[str] | None:
    """Integers, + - * /, parentheses, whitespace; anything else (or too much of it) gives None."""
    tokens: list[str] = []
    i, n = 0, len(expr)
    while i < n:
        ch = expr[i]
        if ch in " \t\n\r":
            i += 1
            continue
        if "0" <= ch <= "9":
            j = i
            while j < n and "0" <= expr[j] <= "9":
                j += 1
            if j - i > MAX_LITERAL_DIGITS or (expr[i] == "0" and j - i > 1):
                return None  # huge literal, or a leading zero ("007" is not a Countdown number)
            tokens.append(expr[i:j])
            i = j
        elif ch in _OPERATORS or ch in "()":
            tokens.append(ch)
            i += 1
        else:
            return None
        if len(tokens) > MAX_EXPRESSION_TOKENS:
            return None
    return tokens


def _evaluate_tokens(tokens: list[str]) -> Fraction | None:
    """Shunting-yard evaluation of binary infix arithmetic; no recursion, so nesting depth is free."""
    values: list[Fraction] = []
    ops: list[str] = []

    def apply() -> bool:
        op = ops.pop()
        if len(values) < 2:
            return False
        right, left = values.pop(), values.pop()
        if op == "+":
            values.append(left + right)
        elif op == "-":
            values.append(left - right)
        elif op == "*":
            values.append(left * right)
        else:
            if right == 0:
                return False
            values.append(left / right)
        return True

    expect_operand = True  # binary operators only: no unary minus, no implicit multiplication
    for tok in tokens:
        if tok.isdigit():
            if not expect_operand:
                return None
            values.append(Fraction(int(tok)))
            expect_operand = False
        elif tok == "(":
            if not expect_operand:
                return None
            ops.append(tok)
        elif tok == ")":
            if expect_operand:
                return None
            while ops and ops[-1] != "(":
                if not apply():
                    return None
            if not ops:
                return None
            ops.pop()
        else:
            if expect_operand:
                return None
            while ops and ops[-1] != "(" and _OPERATORS[ops[-1]] >= _OPERATORS[tok]:
                if not apply():
                    return None
            ops.append(tok)
            expect_operand = True
    if expect_operand:
        return None
    while ops:
        if ops[-1] == "(" or not apply():
            return None
    return values[0] if len(values) == 1 else None


def evaluate_equation(expr: str) -> Fraction | None:
    """The exact value of an arithmetic expression, or None if it is invalid or divides by zero."""
    if not isinstance(expr, str):
        return None
    tokens = _tokenize(expr)
    if not tokens:
        return None
    return _evaluate_tokens(tokens)


def uses_numbers_exactly(expr: str, nums: list[int]) -> bool:
    """True if the integer literals of `expr` are exactly the multiset `nums`."""
    tokens = _tokenize(expr)
    if tokens is None:
        return False
    literals = sorted(int(tok) for tok in tokens if tok.isdigit())
    return literals == sorted(int(n) for n in nums)


def grade(completion: str, nums: list[int], target: int) -> str:
    """`malformed` (no answer the format policy accepts), `wrong` or `correct`, from one parse."""
    if not isinstance(completion, str):
        return "malformed"
    answer = extract_answer(completion)
    if answer is None:
        return "malformed"
    if not uses_numbers_exactly(answer, nums):
        return "wrong"
    value = evaluate_equation(answer)
    return "correct" if value is not None and value == target else "wrong"


def score_of(grade_: str, format_score: float = 0.1, score: float = 1.0) -> float:
    """A grade's reward: 0 if malformed, `format_score` if well-formed but wrong, `score` if correct."""
    return {"malformed": 0.0, "wrong": format_score, "correct": score}[grade_]


def compute_score(
    completion: str,
    nums: list[int],
    target: int,
    format_score: float = 0.1,
    score: float = 1.0,
) -> float:
    """0 if not well-formed, `format_score` if well-formed but wrong, `score` if correct."""
    return score_of(grade(completion, nums, target), format_score, score)


def is_correct(completion: str, nums: list[int], target: int) -> bool:
    """Whether the completion earns the full answer reward."""
    return grade(completion, nums, target) == "correct"


def is_well_formed(completion: str) -> bool:
    """Whether the completion follows the format policy (whatever its equation)."""
    return isinstance(completion, str) and extract_answer(completion) is not None
