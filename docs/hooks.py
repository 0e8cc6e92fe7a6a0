"""mkdocs hooks (``hooks:`` in mkdocs.yml), so the site is rendered from the code and cannot
drift from it:

- the run-config reference page is rendered from dpfl's registry on every build
  (``docs/gen_config_reference.py``), whatever the committed copy says;
- a line ``<!-- docstring: dpfl/methods/<name>.py -->`` in a page is replaced by that
  module's docstring (the method's equations and every CHOICE it makes), read with ``ast``
  (nothing is imported).
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
_MARKER = re.compile(r"^<!-- docstring: (?P<path>[\w/.-]+\.py) -->$", re.MULTILINE)


def _generator():
    spec = importlib.util.spec_from_file_location("dpfl_docs_gen_config_reference",
                                                  DOCS / "gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def module_docstring(path: str) -> str:
    """The docstring of ``ROOT/path`` as a fenced text block (ValueError when it has none)."""
    source = ROOT / path
    doc = ast.get_docstring(ast.parse(source.read_text(encoding="utf-8")))
    if not doc:
        raise ValueError(f"{path} has no module docstring")
    return (f"From the source, `{path}` (its docstring, rendered at build time):\n\n"
            f"```text\n{doc}\n```")


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri == "run-config.md":
        return _generator().render()
    return _MARKER.sub(lambda m: module_docstring(m.group("path")), markdown)
