"""The check every `dpfl` command's bad input must pass: exit 2, one stderr line
``error: ...`` naming what is wrong (tests/test_cli_errors.py, tests/test_bad_input.py)."""

from __future__ import annotations

from dpfl.cli import main


def fails(capsys, argv: list[str], *named: str) -> str:
    """Run ``dpfl ARGV``; assert exit 2 and exactly one ``error:`` line on stderr that
    contains every text of ``named``; return that line."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for text in named:
        assert text in lines[0], lines[0]
    return lines[0]
