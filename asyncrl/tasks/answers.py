"""Strict answer extraction and comparison: graders that cannot be talked into a wrong answer.

Owns: the answer formats ``tag`` (``<answer>...</answer>``), ``boxed`` (``\\boxed{...}``), ``last_number``
and ``plain`` (first line), how each takes *one* answer out of a response, and ``strict_equal`` (a
candidate equals the reference as a number, or as normalized text).
Never: imports math-verify or sympy (free-form grading lives in ``math_verifier.py``), evaluates
anything but arithmetic on numbers (``ast``, no ``eval``), or looks at text before the final line in
``last_number`` mode (the working is free).

Why: math-verify over a free-form response accepts "4 - 1 = 4 + 1 = 5" as 5, "3 or 5" as 5 and "{3, 5}"
as 5, and RL finds such answers within a few dozen steps. The strict rules:
- ``tag``/``boxed``: every tagged (boxed) answer of the response must be the same text, otherwise
  there is no answer; then the whole content must equal the reference (``strict_equal``), so a content
  like "4 - 1 = 4 + 1 = 5" or "3 or 5" scores 0.
- ``last_number``: the answer is the last number of the last non-empty line. If that line is an
  equation chain (``a = b = c``), every side that is pure arithmetic must evaluate to the same value,
  or there is no answer ("4 - 1 = 4 + 1 = 5" has none; "7 + 5 = 12" answers 12). Without ``=``, every
  number on the line must have the same value ("3 or 5" and "1, 2, ..., 12" have none).
Invariants: ``extract`` returns ``None`` for "no single answer"; ``strict_equal`` is symmetric and
never raises on arbitrary text.
"""

from __future__ import annotations

import ast
import re
from fractions import Fraction

from asyncrl.constants import EXTRACT_FORMATS

_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_ARITH = re.compile(r"^[\d\s.,+\-*/×÷()]+$")
_ARITH_TAIL = re.compile(r"[\d\s.+\-*/×÷()]+$")
_ARITH_HEAD = re.compile(r"^[\d\s.+\-*/×÷()]+")
_MAX_ARITH_CHARS = 200


def _boxed_contents(text: str) -> list[str]:
    out, i = [], 0
    while (i := text.find("\\boxed{", i)) >= 0:
        depth, j = 1, i + len("\\boxed{")
        start = j
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        if depth == 0:
            out.append(text[start:j - 1])
        i = j
    return out


def _single(candidates: list[str]) -> str | None:
    values = {normalize(c) for c in candidates}
    return candidates[-1].strip() if len(values) == 1 else None


def normalize(text: str) -> str:
    """Whitespace, ``$``, ``\\text{}``, a trailing period and thousands separators removed."""
    t = text.strip().strip("$").strip()
    t = re.sub(r"\\text\{([^{}]*)\}", r"\1", t)
    t = t.rstrip(".").strip()
    t = re.sub(r"(?<=\d),(?=\d{3}\b)", "", t)
    return re.sub(r"\s+", " ", t)


def as_number(text: str) -> Fraction | None:
    """The exact value of a lone number (``12``, ``-3.5``, ``1,000``, ``3/4``, ``\\frac{3}{4}``), else None."""
    t = normalize(text).replace(" ", "")
    frac = re.fullmatch(r"(-?)\\[dt]?frac\{(\d+)\}\{(\d+)\}", t)
    if frac:
        t = f"{frac.group(1)}{frac.group(2)}/{frac.group(3)}"
    if not re.fullmatch(r"-?(\d+(\.\d+)?|\.\d+)(/\d+)?", t):
        return None
    try:
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None


def strict_equal(candidate: str | None, reference: str) -> bool:
    """``candidate`` is exactly the reference: same number, or the same normalized text."""
    if candidate is None:
        return False
    a, b = as_number(candidate), as_number(reference)
    if a is not None or b is not None:
        return a is not None and a == b
    return normalize(candidate).lower() == normalize(reference).lower() and bool(normalize(candidate))


def _arith_value(expr: str) -> Fraction | None:
    expr = expr.strip().replace("×", "*").replace("÷", "/")
    expr = re.sub(r"(?<=\d),(?=\d{3}\b)", "", expr)
    if not expr or len(expr) > _MAX_ARITH_CHARS or not re.search(r"\d", expr):
        return None
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        return None

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return Fraction(str(node.value))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult | ast.Div):
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Add):
                return left + right
            if isinstance(node.op, ast.Sub):
                return left - right
            if isinstance(node.op, ast.Mult):
                return left * right
            return left / right
        raise ValueError("not arithmetic")

    try:
        return ev(tree)
    except (ValueError, ZeroDivisionError, RecursionError):
        return None


def _last_number(response: str) -> str | None:
    lines = [line for line in response.strip().splitlines() if line.strip()]
    if not lines:
        return None
    line = lines[-1]
    numbers = _NUMBER.findall(line)
    if not numbers:
        return None
    if "=" in line:
        sides = line.split("=")
        values = []
        for k, side in enumerate(sides):
            if k == 0:
                m = _ARITH_TAIL.search(side)
            elif k == len(sides) - 1:
                m = _ARITH_HEAD.match(side.strip())
            else:
                m = _ARITH.match(side.strip())
            value = _arith_value(m.group(0)) if m else None
            if value is not None:
                values.append(value)
        if len(set(values)) > 1:
            return None
    else:
        distinct = {as_number(n) for n in numbers}
        if len(distinct) > 1:
            return None
    return numbers[-1].replace(",", "") if "/" not in numbers[-1] else numbers[-1]


def extract(response: str, fmt: str) -> str | None:
    """The one answer ``response`` gives in format ``fmt`` (module docstring), or ``None``."""
    if fmt == "tag":
        found = _TAG.findall(response)
        return _single(found) if found else None
    if fmt == "boxed":
        found = _boxed_contents(response)
        return _single(found) if found else None
    if fmt == "last_number":
        return _last_number(response)
    if fmt == "plain":
        lines = response.strip().splitlines()
        return lines[0].strip() if lines else ""
    raise ValueError(f"answer format {fmt!r} is not one of {', '.join(EXTRACT_FORMATS)}")


def strict_score(response: str, reference: str, fmt: str) -> float:
    """1.0 when ``response`` gives exactly one answer in ``fmt`` and it is the reference, else 0.0."""
    return 1.0 if strict_equal(extract(response, fmt), reference) else 0.0
