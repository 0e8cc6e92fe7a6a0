"""Generator helpers shared by the tests."""

from __future__ import annotations

import torch


def replay(gen: torch.Generator) -> torch.Generator:
    """A twin of ``gen`` at its current state: it draws exactly what ``gen`` will draw next
    (to rebuild a mechanism's noise in a reference computation)."""
    twin = torch.Generator()
    twin.set_state(gen.get_state())
    return twin
