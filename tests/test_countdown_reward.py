"""countdown_reward: exact values, the format policy, and hostile input (hypothesis)."""

import time
from fractions import Fraction

from hypothesis import given, settings, strategies as st

import countdown_reward as cr

NUMS, TARGET = [3, 5, 7], 22  # 3 * 5 + 7


def wrap(equation: str, thinking: str = " 3*5 is 15, plus 7 ") -> str:
    return f"{thinking}</think> <answer> {equation} </answer>"


def test_correct_answer_gets_full_score():
    assert cr.compute_score(wrap("3 * 5 + 7"), NUMS, TARGET) == 1.0
    assert cr.compute_score(wrap("(7 + 3 * 5)"), NUMS, TARGET) == 1.0
    assert cr.compute_score(wrap("3*5+7") + "\n", NUMS, TARGET, format_score=0.2, score=2.0) == 2.0


def test_wrong_or_invalid_answer_gets_format_score():
    assert cr.compute_score(wrap("3 + 5 + 7"), NUMS, TARGET) == 0.1         # wrong value
    assert cr.compute_score(wrap("3 * 5 + 7 + 0"), NUMS, TARGET) == 0.1     # extra number
    assert cr.compute_score(wrap("5 * 5 - 3"), NUMS, TARGET) == 0.1         # 5 twice, 7 unused
    assert cr.compute_score(wrap("(1 + 2) / 3"), NUMS, TARGET) == 0.1       # the prompt's example
    assert cr.compute_score(wrap("3 ** 5 + 7"), NUMS, TARGET) == 0.1        # no exponentiation
    assert cr.compute_score(wrap("__import__('os')"), NUMS, TARGET) == 0.1  # never executed
    assert cr.compute_score(wrap(""), NUMS, TARGET, format_score=0.3) == 0.3


def test_format_policy_scores_zero():
    assert cr.compute_score("3 * 5 + 7", NUMS, TARGET) == 0.0                        # no tags
    assert cr.compute_score("<answer> 3 * 5 + 7 </answer>", NUMS, TARGET) == 0.0     # no </think>
    assert cr.compute_score("<answer>3*5+7</answer></think>", NUMS, TARGET) == 0.0  # answer inside think
    assert cr.compute_score(wrap("3*5+7") + " done", NUMS, TARGET) == 0.0          # text after the answer
    assert cr.compute_score("</think><answer>1</answer><answer>3*5+7</answer>", NUMS, TARGET) == 0.0
    assert cr.compute_score("</think> <answer> <answer> </answer>", NUMS, TARGET) == 0.0  # the tag-spam hack
    assert cr.compute_score("</think> <answer> 3*5+7", NUMS, TARGET) == 0.0          # unclosed


def test_exact_rational_arithmetic():
    assert cr.evaluate_equation("1 / 3 + 1 / 3 + 1 / 3") == 1       # 0.999... in floats
    assert cr.evaluate_equation("(8 - 2) / 4") == Fraction(3, 2)
    assert cr.evaluate_equation("2 + 3 * 4 - 6 / 2") == 11          # precedence, left associativity
    assert cr.evaluate_equation("10 - 4 - 3") == 3
    assert cr.evaluate_equation("64 / 4 / 2") == 8
    assert cr.compute_score(wrap("(6 / 4) * 8 + 1"), [6, 4, 8, 1], 13) == 1.0
    assert cr.compute_score(wrap("7 / 3 * 3"), [7, 3, 3], 7) == 1.0   # float: 7.000000000000001


def test_invalid_expressions_are_none():
    for expr in ["", "1 +", "(1 + 2", "1 + 2)", "()", "1 2", "-1 + 2", "2(3)", "1 / 0", "1 / (2 - 2)",
                 "1.5 + 2", "0x10", "007 + 1", "1e3", "abs(1)", "1 // 2", "1 % 2", "１ + 2"]:
        assert cr.evaluate_equation(expr) is None, expr


def test_hostile_inputs_are_bounded_and_never_raise():
    cases = [
        "</think><answer>" + "(" * 200_000 + "1" + ")" * 200_000 + "</answer>",
        "</think><answer>" + "9" * 100_000 + "</answer>",
        "</think><answer>" + "*".join(["99999999"] * 20_000) + "</answer>",
        "<answer>" * 50_000 + "</answer>" * 50_000,
        "</think>" * 50_000 + "<answer>1</answer>",
        "\x00\ud800<answer>\u202e</answer>" * 1000,
    ]
    for text in cases:
        start = time.perf_counter()
        assert cr.compute_score(text, NUMS, TARGET) in (0.0, 0.1)
        assert time.perf_counter() - start < 2.0, text[:40]  # a guard against quadratic blow-up, not a benchmark


@settings(max_examples=400, deadline=None)
@given(st.text(), st.lists(st.integers(-5, 200), max_size=6), st.integers(-1000, 1000))
def test_any_text_any_numbers_never_raises(text, nums, target):
    assert cr.compute_score(text, nums, target) in (0.0, 0.1, 1.0)
    assert cr.compute_score(wrap(text), nums, target) in (0.0, 0.1, 1.0)


expressions = st.recursive(
    st.integers(1, 99).map(str),
    lambda inner: st.tuples(inner, st.sampled_from("+-*/"), inner).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None)
@given(expressions)
def test_matches_python_arithmetic_on_valid_expressions(expr):
    """On well-formed input the parser agrees with exact Fraction arithmetic done by Python itself."""
    import re

    as_fractions = re.sub(r"(\d+)", r"Fraction(\1)", expr)
    try:
        expected = eval(as_fractions, {"Fraction": Fraction})  # test oracle on generated input only
    except ZeroDivisionError:
        expected = None
    assert cr.evaluate_equation(expr) == expected
