"""dpfl's ClientApp: the object Flower loads (``dpfl.apps.client:app``), light on purpose.

Importing it imports Flower's app classes only; torch, Opacus, dp-accounting and dpfl's
methods are imported by the handlers (:mod:`dpfl.apps.client_handlers`) on a node's first
message. A simulation loads the ClientApp in its main thread before it starts Ray, while the
ServerApp's thread imports torch: with a heavy module here Ray waited ~2.5 s for those
imports (results/speed/startup-before.txt).

Messages: ``train`` (one round of local training), ``evaluate`` (local validation),
``query.warm`` (before round 1 in a simulation: imports, data and the first plan's noise
multiplier, so that the first instruction does not wait on them), and their cohort bundles
``train.cohort``, ``evaluate.cohort``, ``query.cohort`` (a simulated node that hosts several
clients: each of them through the same handler, :mod:`dpfl.apps.cohort_host`).
"""

from __future__ import annotations

from typing import Callable

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from dpfl.logs import quiet_known_warnings, quiet_routine_flower_records

WARM = "warm"   # query.warm

# the known harmless third-party warnings and Flower's routine records logged as warnings,
# filtered precisely wherever this app runs (a deployment's SuperNode or SuperExec too, and
# the Ray actors of a simulation)
quiet_known_warnings()
quiet_routine_flower_records()


def secure_aggregation_mod(msg: Message, context: Context,
                           call_next: Callable[[Message, Context], Message]) -> Message:
    """SecAgg+ messages (trust=distributed) go through Flower's own secaggplus_mod
    (:func:`dpfl.client.secure.secure_aggregation_mod`, imported on the first message)."""
    from dpfl.client.secure import secure_aggregation_mod as mod

    return mod(msg, context, call_next)


app = ClientApp(mods=[secure_aggregation_mod])


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round of local training (:func:`dpfl.apps.client_handlers.train`)."""
    from dpfl.apps.client_handlers import train as handler

    return handler(msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Local validation (:func:`dpfl.apps.client_handlers.evaluate`)."""
    from dpfl.apps.client_handlers import evaluate as handler

    return handler(msg, context)


@app.query(WARM)
def warm(msg: Message, context: Context) -> Message:
    """The warm-up before round 1 (:func:`dpfl.apps.client_handlers.warm`)."""
    from dpfl.apps.client_handlers import warm as handler

    return handler(msg, context)


@app.train("cohort")
@app.evaluate("cohort")
@app.query("cohort")
def cohort(msg: Message, context: Context) -> Message:
    """A simulation's cohort bundle: several clients of this node, each run through its
    ordinary handler (:func:`dpfl.apps.cohort_host.run_cohort`)."""
    from dpfl.apps.cohort_host import run_cohort

    return run_cohort(msg, context)
