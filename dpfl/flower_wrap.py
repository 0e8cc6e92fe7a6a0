"""Shared by dpfl's wrappers of Flower's entry points (:mod:`dpfl.supernode`,
:mod:`dpfl.superlink`): take one ``--option SECONDS`` of dpfl's out of the argument list and
hand the rest to Flower unchanged."""

from __future__ import annotations

from collections.abc import Sequence


def split_seconds(argv: Sequence[str], option: str, low: float, high: float
                  ) -> tuple[float | None, list[str]]:
    """(the value of ``option`` in seconds, or None; the other arguments). ValueError, naming
    the option, on a missing, non-numeric or out-of-range value."""
    rest: list[str] = []
    value: float | None = None
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg != option and not arg.startswith(option + "="):
            rest.append(arg)
            continue
        if "=" in arg:
            text = arg.split("=", 1)[1]
        elif args:
            text = args.pop(0)
        else:
            raise ValueError(f"{option} needs a value (seconds)")
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{option} '{text}': expected seconds, e.g. 300") from None
        if not low <= value <= high:
            raise ValueError(f"{option} '{text}': expected {low:g}..{high:g} seconds")
    return value, rest
