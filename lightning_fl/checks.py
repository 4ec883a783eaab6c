"""Argument checks shared by the modules and plugins: one message for one mistake."""

from __future__ import annotations

import math


def require_rate(name: str, value: float, example: float, allow_zero: bool = False) -> float:
    """``value`` when it is a finite number > 0 (≥ 0 with ``allow_zero``); otherwise a
    ValueError that names the argument, says what is wrong with the value (NaN and
    infinities by name) and gives an example of a valid one."""
    floor = "≥ 0" if allow_zero else "> 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        problem = f"is {type(value).__name__} {value!r}, not a number"
    elif math.isnan(value):
        problem = "is NaN"
    elif math.isinf(value):
        problem = f"is {'' if value > 0 else 'minus '}infinite"
    elif value < 0 or (value == 0 and not allow_zero):
        problem = f"is {value}, not {floor}"
    else:
        return value
    raise ValueError(f"{name} {problem}: give a finite number {floor}, e.g. {name}={example}.")
