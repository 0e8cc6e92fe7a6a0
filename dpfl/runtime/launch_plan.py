"""What a simulation launch will run (:class:`LaunchPlan`): plain values, decided by the launch's
checks (:func:`dpfl.runtime.preflight.plan_launch`, in a forked child) and read by the launcher,
which never imports what the checks need."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class LaunchPlan:
    """What the launcher runs: the resolved ``output_root``, the ``run_dir`` the ServerApp
    will write, Flower's run-config ``overrides`` (the resume's, a fresh run-name,
    output-dir, cohort-clients), ``supernodes`` simulated nodes, ``workers`` ClientApp worker
    processes (0: Ray's actors), and whether it is a ``resume``. Plain values only: it
    crosses from the checks' process to the launcher as JSON (:meth:`to_json`)."""

    output_root: Path
    run_dir: Path
    overrides: dict[str, object]
    supernodes: int
    workers: int
    resume: bool

    def to_json(self) -> dict[str, Any]:
        return {"output_root": str(self.output_root), "run_dir": str(self.run_dir),
                "overrides": self.overrides, "supernodes": self.supernodes,
                "workers": self.workers, "resume": self.resume}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LaunchPlan:
        return cls(Path(data["output_root"]), Path(data["run_dir"]), dict(data["overrides"]),
                   int(data["supernodes"]), int(data["workers"]), bool(data["resume"]))
