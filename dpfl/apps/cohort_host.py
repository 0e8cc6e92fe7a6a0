"""A cohort host: the simulated SuperNode that answers for several clients per Message.

A bundle (:mod:`dpfl.cohort`) lists the clients of this node that the round sampled; each
is run through the ordinary handler of its message type (:mod:`dpfl.apps.client_handlers`:
``train``, ``evaluate``, ``query.warm``), one after another, exactly as a node of its own
would run it: its own instruction, its own Context (``partition-id`` = the client,
``num-partitions`` = the federation's clients) and its own node state, kept in the host's
state under ``<pid>/``. A client whose handler raises gets an error reply (as Flower gives
a ClientApp that raised); the others go on. Only a simulation sends bundles: a host holds
several clients' data, which a real device never does (docs/privacy.md, "Cohort nodes").

Training is the one step a host may share between its clients: each client's round runs
as a generator (:func:`dpfl.apps.client_handlers.train_steps`) up to its training request;
the requests that can be batched (:func:`dpfl.client.batched_training.why_not_batched`)
are trained together, ``cohort-batch`` clients per call
(:func:`~dpfl.client.batched_training.train_plain_batched`), the others one after another;
then each client's round goes on alone (release, charge, reply). The host's log says once
which path ran and why.
"""

from __future__ import annotations

import traceback
from typing import Callable

from flwr.app import Context, Message, Metadata, RecordDict

from dpfl.apps import client_handlers
from dpfl.apps.client_handlers import TrainingRequest, TrainSteps
from dpfl.client.batched_training import batch_size, train_plain_batched, why_not_batched
from dpfl.client.local_training import Trained
from dpfl.cohort import (
    bundle_replies,
    client_state,
    store_client_state,
    unbundle_instructions,
)
from dpfl.logs import get_logger

log = get_logger("flwr.dpfl.cohort")

Handler = Callable[[Message, Context], Message]
HANDLERS: dict[str, Handler] = {
    "train": client_handlers.train,
    "evaluate": client_handlers.evaluate,
    "query.warm": client_handlers.warm,
}


def client_instruction(bundle: Message, pid: int, inner_type: str,
                       content: RecordDict) -> Message:
    """Client ``pid``'s instruction out of ``bundle``: its records and the bundle's
    metadata with the inner message type (built without Flower's process identity, which a
    ClientApp process need not have)."""
    meta = bundle.metadata
    return Message(metadata=Metadata(
        run_id=meta.run_id, message_id=f"{meta.message_id}/{pid}",
        src_node_id=meta.src_node_id, dst_node_id=meta.dst_node_id,
        reply_to_message_id="", group_id=meta.group_id, created_at=meta.created_at,
        ttl=meta.ttl, message_type=inner_type), content=content)


def client_context(host: Context, pid: int, num_clients: int) -> Context:
    """Client ``pid``'s Context on ``host``: its partition and its own node state."""
    return Context(run_id=host.run_id, node_id=host.node_id,
                   node_config={**host.node_config, "partition-id": pid,
                                "num-partitions": num_clients},
                   state=client_state(host.state, pid), run_config=host.run_config)


def _answer(reply: Message) -> RecordDict | str:
    return f"{reply.error.reason}" if reply.has_error() else reply.content


def _failure(pid: int, exc: Exception) -> str:
    """One client's exception, logged, as the error reason Flower would give it."""
    log.error("client %d of a cohort: %s", pid, traceback.format_exc())
    return f"{type(exc)}:<'{exc}'>"


def run_cohort(msg: Message, context: Context) -> Message:
    """Answer a bundle: each listed client's handler in turn, one reply bundle."""
    inner_type, num_clients, contents = unbundle_instructions(msg.content)
    handler = HANDLERS.get(inner_type)
    if handler is None:
        raise ValueError(f"a cohort of '{inner_type}' messages: no such handler")
    if inner_type == "train":
        return Message(bundle_replies(_train(msg, context, num_clients, contents)),
                       reply_to=msg)
    replies: dict[int, RecordDict | str] = {}
    for pid, content in contents.items():
        own = client_context(context, pid, num_clients)
        try:
            replies[pid] = _answer(handler(client_instruction(msg, pid, inner_type, content),
                                           own))
        except Exception as exc:  # noqa: BLE001 - one client's failure, as Flower reports it
            replies[pid] = _failure(pid, exc)
        # kept whatever happened: a charge recorded before a failure stays recorded
        store_client_state(context.state, pid, own.state)
    return Message(bundle_replies(replies), reply_to=msg)


def _train(msg: Message, context: Context, num_clients: int,
           contents: dict[int, RecordDict]) -> dict[int, RecordDict | str]:
    """Each client's train round up to its training request, the requests trained
    (batched where they can be), then each round to its reply."""
    replies: dict[int, RecordDict | str] = {}
    waiting: dict[int, tuple[TrainSteps, TrainingRequest, Context]] = {}
    for pid, content in contents.items():
        own = client_context(context, pid, num_clients)
        steps = client_handlers.train_steps(client_instruction(msg, pid, "train", content), own)
        try:
            waiting[pid] = (steps, next(steps), own)
            continue
        except StopIteration as done:   # refused: nothing to train
            replies[pid] = _answer(done.value)
        except Exception as exc:  # noqa: BLE001 - one client's failure, as Flower reports it
            replies[pid] = _failure(pid, exc)
        store_client_state(context.state, pid, own.state)
    batched = train_batched({pid: request for pid, (_, request, _) in waiting.items()})
    for pid, (steps, request, own) in waiting.items():
        try:
            trained = batched[pid] if pid in batched else request.train()
            replies[pid] = _answer(client_handlers.finish_training(steps, trained))
        except Exception as exc:  # noqa: BLE001 - one client's failure, as Flower reports it
            replies[pid] = _failure(pid, exc)
        store_client_state(context.state, pid, own.state)
    return replies


_said: set[str] = set()


def _say_once(text: str) -> None:
    if text not in _said:
        _said.add(text)
        log.info(text)


def train_batched(requests: dict[int, TrainingRequest]) -> dict[int, Trained]:
    """The requests that can be trained together, trained ``cohort-batch`` at a time
    (their models left trained); the others are not in the answer (trained one by one)."""
    if not requests:
        return {}
    first = next(iter(requests.values())).job
    cfg = first.cfg
    size = batch_size(cfg.cohort_batch, first.device)
    if size < 2:
        _say_once("cohort training: one client after another (cohort-batch "
                  f"{cfg.cohort_batch}{' on CPU' if cfg.cohort_batch < 0 else ''})")
        return {}
    eligible = []
    for pid, request in requests.items():
        job = request.job
        why = why_not_batched(job.cfg, job.model, job.hooks)
        if why is None:
            eligible.append(pid)
        else:
            _say_once(f"cohort training: one client after another ({why})")
    out: dict[int, Trained] = {}
    for start in range(0, len(eligible), size):
        chunk = eligible[start:start + size]
        if len(chunk) < 2:
            continue
        jobs = [requests[pid].job for pid in chunk]
        try:
            results = train_plain_batched([j.model for j in jobs], [j.data for j in jobs], cfg,
                                          [j.shuffle_seed for j in jobs], jobs[0].device)
        except Exception:  # noqa: BLE001 - the models are untouched: train them one by one
            log.warning("cohort training: the batched call failed, training these %d clients "
                        "one after another: %s", len(chunk), traceback.format_exc())
            continue
        for pid, job, result in zip(chunk, jobs, results):
            out[pid] = Trained(result, job.update())
        _say_once(f"cohort training: batched (torch.func.vmap), up to {size} clients per "
                  "call")
    return out
