"""Shared by dpfl's wrappers of Flower's entry points (:mod:`dpfl.runtime.supernode`,
:mod:`dpfl.runtime.superlink`): take one ``--option SECONDS`` of dpfl's out of the argument
list and hand the rest to Flower unchanged."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence


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


def run_wrapped(module: str, option: str, low: float, high: float,
                apply: Callable[[float], None], flower_name: str,
                flower_main: Callable[[], Callable[[], None]],
                argv: Sequence[str] | None = None) -> None:
    """Take ``option`` out of the arguments (a bad value: one line naming ``module``, exit
    2), ``apply`` its value if given, then run Flower's entry point ``flower_main()`` as
    ``flower_name`` with the other arguments."""
    try:
        value, rest = split_seconds(sys.argv[1:] if argv is None else argv, option, low, high)
    except ValueError as exc:
        print(f"{module}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if value is not None:
        apply(value)
    entry = flower_main()
    sys.argv = [flower_name, *rest]
    entry()
