"""What counts as a number in a message, a record or a config: an int or float, never a bool.

Python's ``bool`` is a subclass of ``int``, so ``isinstance(True, (int, float))`` holds; a
client reply or a JSON record that carries ``true`` where a count, an epsilon or a loss
belongs must still be refused. Every such check in dpfl goes through these two functions.
"""

from __future__ import annotations

import math
from typing import Any, TypeGuard


def is_number(value: Any) -> TypeGuard[int | float]:
    """An ``int`` or ``float`` (NaN and infinities included), not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite_number(value: Any) -> bool:
    """A :func:`is_number` value that is neither NaN nor infinite."""
    return is_number(value) and math.isfinite(value)
