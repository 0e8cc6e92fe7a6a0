"""The documentation site builds strictly (no broken link, no missing page, no page left out
of the nav), and its run-config reference, generated from the registry, documents every key
there is: the global keys, every method's own keys and every key of the pyproject's run
config (the three lists checked against each other by tests/test_methods_registry.py)."""

import html
import importlib.util
import os
import tomllib
from pathlib import Path

import pytest

from dpfl.config import GLOBAL_KEYS
from dpfl.methods import METHODS, key_reference, method_keys

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference",
                                                  ROOT / "docs" / "gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _all_keys() -> set[str]:
    return set(GLOBAL_KEYS) | set(method_keys()) | set(PYPROJECT)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """``mkdocs build --strict`` into a temporary folder, in this process (dpfl is imported
    once: the reference hook reads the registry)."""
    missing = [m for m in ("mkdocs", "pymdownx") if importlib.util.find_spec(m) is None]
    if missing:
        reason = f"{' and '.join(missing)} not installed (the 'docs' extra)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason + ": CI must build the docs")
        pytest.skip(reason)
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    out = tmp_path_factory.mktemp("site")
    cwd = os.getcwd()
    os.chdir(ROOT)   # mkdocs.yml names its hook relative to the repository
    try:
        build(load_config(config_file=str(ROOT / "mkdocs.yml"), site_dir=str(out),
                          strict=True))
    finally:
        os.chdir(cwd)
    return out


def test_the_site_builds_strictly_with_every_page(site):
    nav_pages = ["index", "user-guide", "run-config", "privacy", "trust-models", "attacks",
                 "deployment", "ray-cluster", "reproductions", "architecture",
                 "methods/index", "methods/gcfl", "methods/fedcompdp", "methods/aadp",
                 "methods/pegasus", "methods/fedasgp", "methods/baselines"]
    missing = [p for p in nav_pages if not (site / f"{p}.html").is_file()]
    assert not missing, missing
    # the hook replaced every docstring marker by the module's docstring
    baselines = (site / "methods" / "baselines.html").read_text()
    assert "docstring:" not in baselines and "momentum_step" not in baselines
    assert "heavy-ball momentum" in baselines


def test_the_built_reference_lists_every_key(site):
    page = html.unescape((site / "run-config.html").read_text())
    missing = sorted(k for k in _all_keys() if f"<code>{k}</code>" not in page)
    assert not missing, f"keys missing from the built run-config reference: {missing}"


def test_the_generated_reference_documents_every_key_and_method():
    text = _generator().render()
    missing = sorted(k for k in _all_keys() if f"| `{k}` |" not in text)
    assert not missing, missing
    for doc in key_reference():
        assert doc.help.strip(), f"'{doc.key}' has no description"
    for name, method in METHODS.items():
        if method.params is not None:
            assert f"### `{name}`" in text


def test_the_committed_reference_is_the_generated_one():
    """What GitHub shows (docs/run-config.md) is what the registry says; regenerate with
    ``python docs/gen_config_reference.py``."""
    committed = (ROOT / "docs" / "run-config.md").read_text(encoding="utf-8")
    assert committed == _generator().render(), \
        "docs/run-config.md is stale: run python docs/gen_config_reference.py"


def test_a_key_without_a_description_stops_the_reference(monkeypatch):
    import dpfl.config

    monkeypatch.delitem(dpfl.config.KEY_HELP, "lr")
    with pytest.raises(ValueError, match="global key 'lr' has no description"):
        key_reference()
