"""What an environment-dependent e2e test needs (root, binaries, working kernel features),
checked at the start of the test.

Outside CI a missing requirement skips the test, as before. With ``CI`` set to true in the
environment (``CI=true``, as GitHub Actions, GitLab and most CI services set it) it fails
the test instead, naming what is missing: a CI job that silently skips the deployment tests
would report green without having run them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterable, Mapping

import pytest

CI_TRUE = ("1", "true", "yes")


def in_ci(environ: Mapping[str, str] | None = None) -> bool:
    """True when the environment says this is a CI run (CI=true, 1 or yes)."""
    env = os.environ if environ is None else environ
    return env.get("CI", "").strip().lower() in CI_TRUE


def command_works(*cmd: str) -> Callable[[], bool]:
    """A probe: does ``cmd`` run and exit 0 (e.g. ``ip netns list``)?"""
    def probe() -> bool:
        try:
            return subprocess.run(list(cmd), capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False
    probe.__name__ = " ".join(cmd)
    return probe


def missing_requirements(tools: Iterable[str] = (), root: bool = False,
                         probes: Mapping[str, Callable[[], bool]] | None = None) -> list[str]:
    """Human-readable names of what is missing (empty when everything is there)."""
    missing = []
    if root and os.geteuid() != 0:
        missing.append("root (effective uid 0)")
    missing += [f"'{tool}' on PATH" for tool in tools if shutil.which(tool) is None]
    for name, probe in (probes or {}).items():
        if not probe():
            missing.append(f"a working '{name}'")
    return missing


def require(tools: Iterable[str] = (), root: bool = False,
            probes: Mapping[str, Callable[[], bool]] | None = None, what: str = "this test",
            environ: Mapping[str, str] | None = None) -> None:
    """Skip the calling test (fail it under CI=true) unless every requirement is met.
    Call it first thing in the test body, so that under CI the test is reported FAILED
    (a failure inside a fixture would be reported as an error)."""
    missing = missing_requirements(tools, root, probes)
    if not missing:
        return
    message = f"{what} needs {', '.join(missing)}"
    if in_ci(environ):
        pytest.fail(f"{message} (CI=true: a missing requirement fails the test instead of "
                    "skipping it)", pytrace=False)
    pytest.skip(message)
