"""dpfl's ClientApp handlers: local (DP) training and local evaluation over Flower's Message
API (registered by the light :mod:`dpfl.apps.client`, which imports this module on a node's
first message).

The configured method's client half (``dpfl.method.ClientHalf``) sets the round's noise
multiplier, local-training hooks and update clipping; this module names no method.

A train reply carries ``arrays`` (the update = trained - received, same keys as the global
model), ``metrics`` (num-examples, train-loss, epsilon, delta, ...) and ``privacy`` (the
mechanism and its public parameters, so the server can recompute epsilon). A client whose
next round would exceed its epsilon budget does not train: it replies with ``status`` =
refused and the reason, and spends nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator
from dataclasses import dataclass

import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)

from dpfl.client.batched_training import why_not_batched
from dpfl.client.budget import ClientBudget
from dpfl.client.job import ClientJob
from dpfl.client.local_training import Trained, Trainer, trainer_for
from dpfl.client.release import release_for
from dpfl.config import RunConfig
from dpfl.data import ClientData, client_data
from dpfl.method import ClientHalf
from dpfl.methods import method_for, parse_run_config
from dpfl.models.evaluation import device_for, evaluate_model
from dpfl.privacy.plan import shared_plan


def _threads() -> None:
    n = int(os.environ.get("DPFL_NUM_THREADS", "0") or 0)
    if n > 0 and torch.get_num_threads() != n:
        torch.set_num_threads(n)


def _partition(context: Context) -> tuple[int, int]:
    try:
        return int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    except KeyError as exc:
        raise ValueError("this SuperNode needs --node-config 'partition-id=<i> "
                         "num-partitions=<n>'") from exc


# the last received model, decoded: a cohort node's clients share one ArrayRecord object
_received: list = [None, None]


def _received_state(arrays: ArrayRecord) -> dict[str, torch.Tensor]:
    """``arrays`` as tensors, decoded once per received record (loading copies them into
    each client's own model, so the decoded tensors are only read)."""
    if _received[0] is not arrays:
        _received[:] = [arrays, arrays.to_torch_state_dict()]
    return _received[1]


# Models of finished client rounds, kept for this process's next clients (a cohort host
# trains many a round): building one initialises every layer only for the received weights
# to overwrite them, ~0.5 ms of a ~4 ms one-step client (results/speed/). Keyed by what
# builds them; only models that plain local SGD trained go back (:func:`_keep_model`).
_spare_models: dict[tuple, list[torch.nn.Module]] = {}
SPARE_MODELS = 256   # per kind of model: a cohort's clients, with room


def _model_kind(cfg: RunConfig, data: ClientData) -> tuple:
    return (cfg.strategy, cfg.model, tuple(data.x_train.shape[1:]), data.num_classes)


def _model(cfg: RunConfig, data: ClientData, arrays: ArrayRecord) -> torch.nn.Module:
    """The received model: a spare one of the same kind with the received weights loaded
    (every parameter and buffer, strictly), else a new one."""
    spare = _spare_models.get(_model_kind(cfg, data))
    if spare:
        model = spare.pop()
    else:
        model = method_for(cfg).build_model(cfg, tuple(data.x_train.shape[1:]),
                                            data.num_classes)
    model.load_state_dict(_received_state(arrays))
    return model


def _keep_model(job: ClientJob) -> None:
    """Keep ``job``'s model for a later client once its round is over, when nothing of
    its training can stay in it: trained by plain local SGD with no method step hooks
    (not Opacus, which hooks the model; no buffers, no dropout:
    :func:`~dpfl.client.batched_training.why_not_batched`), in the usual contiguous layout,
    its gradients dropped. Its weights are overwritten by the next client's load."""
    model = job.model
    if (why_not_batched(job.cfg, model, job.hooks) is not None
            or type(model).__module__.startswith("opacus")
            or not all(p.is_contiguous() for p in model.parameters())):
        return
    spare = _spare_models.setdefault(_model_kind(job.cfg, job.data), [])
    if len(spare) < SPARE_MODELS:
        for p in model.parameters():
            p.grad = None
        spare.append(model)


# the last run-config parsed: a cohort node's clients (and a node's rounds) share it
_parsed: list = [None, None]


def _run_config(context: Context) -> RunConfig:
    """The node's run-config, parsed once per distinct content."""
    key = tuple(sorted((k, repr(v)) for k, v in context.run_config.items()))
    if _parsed[0] != key:
        _parsed[:] = [key, parse_run_config(context.run_config)]
    return _parsed[1]


def _state_bytes(context: Context) -> int:
    """Bytes this node keeps between rounds (its privacy history, SecAgg+ keys, ...)."""
    return int(sum(record.count_bytes() for record in context.state.values()))


@dataclass
class TrainingRequest:
    """What a client's round asks of its trainer: train ``job`` (at noise multiplier
    ``sigma`` under DP-SGD) with ``trainer``; answered with a :class:`Trained`."""

    job: ClientJob
    trainer: Trainer
    sigma: float | None = None

    def train(self) -> Trained:
        return self.trainer.train(self.job, self.sigma)


TrainSteps = Generator[TrainingRequest, Trained, Message]


def train(msg: Message, context: Context) -> Message:
    """One round of local training: the client's plan, its budget check, the trainer, the
    trust model's release, the reply (``dpfl.client``: job, budget, local_training,
    release)."""
    return finish_training(train_steps(msg, context))


def finish_training(steps: TrainSteps, trained: Trained | None = None) -> Message:
    """Run a client's round (:func:`train_steps`) to its reply, its training by its own
    trainer; ``trained``: the answer to the request it already made (a cohort host's
    batched training)."""
    try:
        request = next(steps) if trained is None else steps.send(trained)
        while True:
            request = steps.send(request.train())
    except StopIteration as done:
        return done.value


def train_steps(msg: Message, context: Context) -> TrainSteps:
    """:func:`train` as a generator that yields its one :class:`TrainingRequest` and is
    sent the training: a cohort host (:mod:`dpfl.apps.cohort_host`) gathers its clients'
    requests and trains them together; everything before and after stays per client."""
    _threads()
    job = _job(msg, context)
    release = release_for(job.cfg)
    trainer = trainer_for(job.cfg)
    if not release.charges:   # no DP, or a trusted server noises and charges (central)
        trained = yield TrainingRequest(job, trainer)
        out = release.release(job, trained, None, _state_bytes(context))
        metrics = {**job.base_metrics(), **out.metrics}
        reply = _reply(msg, trained, job, arrays=out.arrays, metrics=metrics,
                       privacy=ConfigRecord(out.privacy or {}))
        _keep_model(job)
        return reply

    budget = ClientBudget(job, context.state, context.node_config, context.run_id,
                          adaptive=method_for(job.cfg).adaptive)
    planned = release.planned_event(job)
    reason = budget.refusal(planned)
    if reason is not None:   # nothing trained, nothing spent
        return Message(RecordDict({
            "metrics": MetricRecord({**job.base_metrics(), "epsilon": budget.epsilon(),
                                     "refused": 1}),
            "status": ConfigRecord({"status": "refused", "reason": reason})}), reply_to=msg)
    trained = yield TrainingRequest(job, trainer, planned.sigma)
    out = release.release(job, trained, planned, _state_bytes(context))
    assert out.event is not None
    budget.charge(out.event)
    metrics = {**job.base_metrics(), "num-examples": out.num_examples,
               "epsilon": budget.epsilon(), "noise-multiplier": planned.sigma,
               "node-state-bytes": _state_bytes(context), "sample-rate": out.event.rate,
               "steps": out.event.steps, **out.metrics}
    reply = _reply(msg, trained, job, arrays=out.arrays, metrics=metrics,
                   privacy=budget.privacy_record(out.event, out.clip))
    _keep_model(job)
    return reply


def _job(msg: Message, context: Context) -> ClientJob:
    """This instruction's client round: the run-config, the server's config, the client's
    partition and data, the received model, the method's client half and hooks."""
    cfg = _run_config(context)
    config = msg.content["config"]
    server_round = int(config.get("server-round", 0))
    pid, nparts = _partition(context)
    data = client_data(cfg, pid, nparts)
    model = _model(cfg, data, msg.content["arrays"])
    method = method_for(cfg)
    half = method.client
    post_process = None
    if type(half).post_process is not ClientHalf.post_process:
        def post_process(flat: torch.Tensor) -> torch.Tensor:
            return half.post_process(cfg, flat, server_round)
    job = ClientJob(cfg, config, server_round, pid, nparts, data, model, device_for(), half,
                    post_process, plan_fn=method.plan)
    job.hooks = half.hooks(cfg, msg, context, model)   # after the received copy
    return job


def _reply(msg: Message, trained: Trained, job: ClientJob, arrays: dict[str, torch.Tensor],
           metrics: dict, privacy: ConfigRecord) -> Message:
    """The train reply: the released arrays, the metrics (the private mean training loss
    only when ``report-train-loss``), the privacy record and the method's extra records."""
    if job.cfg.report_train_loss:
        metrics["train-loss"] = trained.result.train_loss
    extras = job.hooks.finish(job.model, trained.result)
    return Message(RecordDict({"arrays": ArrayRecord(arrays), "metrics": MetricRecord(metrics),
                               "privacy": privacy, **extras}), reply_to=msg)


def evaluate(msg: Message, context: Context) -> Message:
    """Loss and accuracy of the received model on the client's local validation split.

    These metrics are computed from private data and released in the clear: they are not
    covered by the DP guarantee (keep ``fraction-evaluate = 0`` for a strictly DP run).
    """
    _threads()
    cfg = _run_config(context)
    pid, nparts = _partition(context)
    data = client_data(cfg, pid, nparts)
    model = _model(cfg, data, msg.content["arrays"])
    loss, preds = evaluate_model(model, data.x_val, data.y_val, device_for())
    n = len(data.y_val)
    acc = float((preds == data.y_val).float().mean()) if n else 0.0
    return Message(RecordDict({"metrics": MetricRecord({
        "partition-id": pid, "num-examples": max(n, 1), "val-loss": loss,
        "val-accuracy": acc})}), reply_to=msg)


def warm(msg: Message, context: Context) -> Message:
    """Before round 1 (``query.warm``, sent by a simulation's ServerApp while it sets up):
    what this node's first instruction would otherwise wait on — the imports (torch, the
    method registry, Opacus under DP-SGD), its data, and the shared plan's noise multiplier
    (calibrated or its memo entry checked, cached in this process). Releases nothing from
    the data: the reply holds the partition id and how long the warm-up took."""
    start = time.perf_counter()
    _threads()
    cfg = _run_config(context)
    pid, nparts = _partition(context)
    data = client_data(cfg, pid, nparts)
    trainer_for(cfg).warm()
    release_for(cfg).warm(cfg, len(data.y_train), method_for(cfg).plan is shared_plan)
    return Message(RecordDict({"metrics": MetricRecord({
        "partition-id": pid, "warm-seconds": time.perf_counter() - start})}), reply_to=msg)
