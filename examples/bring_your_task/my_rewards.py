"""Two reward functions in plain Python for the example task (docs/bring_your_task.md)."""

import sympy


def formatted(prompts, completions, **columns):
    """The share of the answer's characters that are digits (a bare number: 1)."""
    return [sum(ch.isdigit() for ch in c) / len(c) if c else 0.0 for c in completions]


def correct(prompts, completions, answer, **columns):
    """1 when the answer is the reference number (sympy reads "7", "7.0" and "14/2"
    alike), 0 otherwise; None (not scored) where the reference is not a number."""
    scores = []
    for completion, reference in zip(completions, answer):
        try:
            expected = sympy.Rational(reference)
        except (TypeError, ValueError):
            scores.append(None)
            continue
        try:
            scores.append(float(sympy.Rational(completion.strip()) == expected))
        except (TypeError, ValueError, ZeroDivisionError):  # "7x", "", "3/0"
            scores.append(0.0)
    return scores
