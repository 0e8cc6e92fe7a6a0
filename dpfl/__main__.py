"""``python -m dpfl``: the ``dpfl`` command (:mod:`dpfl.cli`)."""

import sys

from dpfl.cli import main

sys.exit(main())
