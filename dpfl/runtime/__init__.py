"""The runtime: starting and stopping Flower's processes around dpfl's app.

``dpfl simulate``'s launcher (:mod:`.launch`: the simulation SuperLink, pre-flight checks,
exit status) and ``dpfl deploy``'s containerised federation (:mod:`.containers`); Flower's
entry points with dpfl's settings (:mod:`.superlink`, :mod:`.supernode`, their shared option
parsing :mod:`.flower_wrap`); warm ClientApps and simulations forked from a preloaded zygote
(:mod:`.warm_clientapps`); the staged Flower app and its FAB (:mod:`.fab`); the watchdog that
stops a federation with its launcher (:mod:`.watchdog`).

Nothing here is imported by the ServerApp, the ClientApp or the layers below them; the
modules are imported where they are used (``python -m dpfl.runtime.<module>`` for the
process entry points), not re-exported here.
"""
