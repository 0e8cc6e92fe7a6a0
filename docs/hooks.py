"""mkdocs hooks (``hooks:`` in mkdocs.yml): the run-config reference page is rendered from
dpfl's registry on every build (``docs/gen_config_reference.py``), so the site cannot show
a stale key table whatever the committed copy says."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_GEN = Path(__file__).resolve().parent / "gen_config_reference.py"


def _generator():
    spec = importlib.util.spec_from_file_location("dpfl_docs_gen_config_reference", _GEN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri == "run-config.md":
        return _generator().render()
    return markdown
