#!/usr/bin/env bash
# pfl-research (Apple's `pfl` on PyPI) in its own venv, for the side-by-side bench
# (bench/pfl_compare.py). A bench extra: dpfl neither imports nor depends on pfl.
#
#   bench/pfl/setup.sh                      # -> bench/pfl/.venv (gitignored)
#   PFL_VENV=/some/dir bench/pfl/setup.sh   # elsewhere
#
# Env: PFL_VENV (the venv), PFL_VERSION (default 0.6.0; when pip cannot find it, the newest
# pfl it finds), PFL_TORCH (a pip spec; default: the torch version of dpfl's .venv if there
# is one, so both systems run the same torch build, else torch==2.14.1), PYTHON (default
# python3.11; pfl 0.6.0 needs Python >= 3.10, < 3.13).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="${PFL_VENV:-$HERE/.venv}"
PY="${PYTHON:-python3.11}"
PFL_VERSION="${PFL_VERSION:-0.6.0}"

if [ -z "${PFL_TORCH:-}" ]; then
    if [ -x "$ROOT/.venv/bin/python" ] && \
        v="$("$ROOT/.venv/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null)"; then
        PFL_TORCH="torch==${v%%+*}"   # 2.14.1+cu130 -> torch==2.14.1 (any local label)
    else
        PFL_TORCH="torch==2.14.1"
    fi
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# pip prints a warning per package for the extra file:// index folders it lacks: drop those
# the pytorch extra (pfl 0.6.0 has one: torch>=2.0.1,<3) plus the pinned torch build
pip_install() {
    "$VENV/bin/python" -m pip install -q "$@" 2> >(grep -v "is ignored: it is neither" >&2)
}
if ! pip_install "pfl[pytorch]==$PFL_VERSION" "$PFL_TORCH"; then
    echo "pfl==$PFL_VERSION not installable here; trying the newest pfl pip finds" >&2
    pip_install "pfl[pytorch]" "$PFL_TORCH"
fi
"$VENV/bin/python" - <<'PY'
import platform
from importlib.metadata import version

import pfl
import torch

print(f"python {platform.python_version()}  pfl {version('pfl')}  torch {torch.__version__}  "
      f"dp-accounting {version('dp-accounting')}  prv-accountant {version('prv-accountant')}  "
      f"numpy {version('numpy')}  ({pfl.__file__})")
PY
