"""Hatchling build hook: an installed dpfl runs without its source checkout.

The wheel carries the checkout's ``pyproject.toml`` (the Flower app: its components,
``fab-include`` and every run-config default) and ``conf/`` (the papers' presets) as package
data in ``dpfl/_flower_app/`` (:data:`dpfl.runtime.fab.INSTALLED_APP`), copied unchanged: one source
of truth, read by ``dpfl simulate``, ``dpfl audit`` and ``dpfl reproduce`` through
:func:`dpfl.runtime.fab.app_folder`. An editable install gets no copy (it reads the checkout's own
files); hatchling's ``force-include`` setting would copy them into it too.
"""

from __future__ import annotations

from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

# checkout path -> path in the wheel (dpfl.runtime.fab.INSTALLED_APP)
APP_FILES = {"pyproject.toml": "dpfl/_flower_app/pyproject.toml",
             "conf": "dpfl/_flower_app/conf"}


class FlowerAppHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name == "wheel" and version == "standard":
            build_data["force_include"].update(APP_FILES)
