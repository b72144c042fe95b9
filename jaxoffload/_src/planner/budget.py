"""Budgets as users write them: bytes or a share, and what to write instead of a string."""

from __future__ import annotations

__all__ = ["check_budget"]


def check_budget(budget) -> None:
    """Raises unless ``budget`` is bytes (a positive int) or a share (a float in (0, 1])."""
    if isinstance(budget, str):
        raise TypeError(
            f"budget must be bytes (an int) or a share (a float), got the string {budget!r}; "
            f"{_budget_hint(budget)}."
        )
    if isinstance(budget, bool) or not isinstance(budget, int | float):
        raise TypeError(f"budget must be bytes (an int) or a share (a float), got {budget!r}.")
    if isinstance(budget, float) and not 0 < budget <= 1:
        raise ValueError(
            f"a budget given as a float is a share of the plain step's memory, in (0, 1]; got "
            f"{budget}. Give bytes as an int."
        )
    if isinstance(budget, int) and budget <= 0:
        raise ValueError(f"budget must be positive, got {budget} bytes.")


# Units that a budget written as a string may end with, as Python writes them.
_UNITS = {"%": "/ 100", "gib": "* 2**30", "mib": "* 2**20", "gb": "* 10**9", "mb": "* 10**6"}


def _budget_hint(text: str) -> str:
    """What to write instead of a budget given as a string: ``'0.5'``, ``'50%'``, ``'8 GiB'``."""
    number = text.strip()
    unit = next((u for u in _UNITS if number.lower().endswith(u)), None)
    number = number[: -len(unit)].strip() if unit else number
    try:
        value = float(number)
    except ValueError:
        return (
            "write bytes as an int (budget=8 * 2**30 for 8 GiB) or a share as a float (budget=0.5)"
        )
    if unit == "%":
        return f"write budget={value / 100!r}, a share of the plain step's memory"
    if unit:
        scaled = f"{number} {_UNITS[unit]}"
        return f"write budget={scaled if value.is_integer() else f'int({scaled})'}, in bytes"
    if number.isdigit() or value > 1:
        return f"write budget={int(value)}, in bytes"
    return f"write budget={value!r}, a share of the plain step's memory"
