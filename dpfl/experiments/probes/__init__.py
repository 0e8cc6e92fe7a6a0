"""In-process probes (no Flower) behind the GCFL reproduction's findings; their logs are in
``results/gcfl/`` and ``results/gcfl/README.md`` reads them.

- ``gcfl_lr_sweep``: the learning-rate sweep that chose ``lr`` in ``conf/gcfl/*.toml``.
- ``gcfl_cosine``: the cosine between the two clients' round updates (GCFL corrects only
  negative ones).
- ``gcfl_per_step``: GCFL's Algorithm 1 as written (per-step gradient exchange).

Each runs as ``python -m dpfl.experiments.probes.<name> key=value ...`` (run-config keys,
dashes or underscores) and prints one line per round or epoch.
"""

from __future__ import annotations

from dpfl.config import RunConfig


def parse_args(argv: list[str]) -> dict[str, str]:
    """``key=value`` arguments as a dict (values still text)."""
    return dict(a.split("=", 1) for a in argv)


def config_from(base: RunConfig, changes: dict[str, str]) -> RunConfig:
    """``base`` with run-config keys (dashes or underscores) replaced, each value converted
    to the type of the field it replaces."""
    fields = {k.replace("-", "_"): v for k, v in changes.items()}
    return base.replace(**{k: type(getattr(base, k))(v) for k, v in fields.items()})
