"""``python -m dpfl``: the ``dpfl`` command (:mod:`dpfl.cli`)."""

from dpfl.cli import entry

entry()
