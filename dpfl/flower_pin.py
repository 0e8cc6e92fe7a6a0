"""The Flower release whose internals dpfl patches were checked on, and the check itself.

dpfl replaces pieces of Flower 1.39's simulation internals, each only while Flower is
the release they were written against and the code they replace or rely on is unchanged:
the LinkState's per-node instruction index (:mod:`dpfl.server.node_index`), the
simulation's ClientApp backend and its instruction poll
(:mod:`dpfl.runtime.process_backend`). A changed Flower runs
unpatched, and the caller says why.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Mapping
from typing import Any

PINNED_FLWR = "1.39.0"

# The attribute of a simulation's LinkState (:mod:`dpfl.server.node_index`) holding a
# ``threading.Event`` set whenever an instruction is stored: the simulation runtime's
# instruction poll (:mod:`dpfl.runtime.process_backend`) wakes on it instead of waiting out
# its 0.1 s sleep.
INSTRUCTIONS_ARRIVED = "dpfl_instructions_arrived"


def source_sha256(function: Any) -> str:
    """sha256 (hex) of a function's or method's source text, as ``inspect.getsource``
    returns it."""
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()


def pin_problem(owner: Any, label: str, digests: Mapping[str, str]) -> str | None:
    """None when the installed ``flwr`` is :data:`PINNED_FLWR` and every attribute of
    ``owner`` named in ``digests`` has the source digest given there; else why not
    (``label``: how the owner is named in that reason)."""
    import flwr

    version = getattr(flwr, "__version__", "")
    if version != PINNED_FLWR:
        return f"flwr {version} is not the pinned {PINNED_FLWR}"
    for name, digest in digests.items():
        if source_sha256(getattr(owner, name)) != digest:
            return f"{label}.{name} differs from flwr {PINNED_FLWR}'s"
    return None
