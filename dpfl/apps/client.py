"""dpfl's ClientApp: local (DP) training and local evaluation over Flower's Message API.

The configured method's client half (``dpfl.method.ClientHalf``) sets the round's noise
multiplier, local-training hooks and update clipping; this module names no method.

A train reply carries ``arrays`` (the update = trained - received, same keys as the global
model), ``metrics`` (num-examples, train-loss, epsilon, delta, ...) and ``privacy`` (the
mechanism and its public parameters, so the server can recompute epsilon). A client whose
next round would exceed its epsilon budget does not train: it replies with ``status`` =
refused and the reason, and spends nothing.
"""

from __future__ import annotations

import math
import os

import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp

from dpfl.client.canary import canary_update, is_canary, with_canary_examples
from dpfl.client.node_history import NodeHistoryError, adopt, history_path, record
from dpfl.client.secure import (
    UNCLIPPED_KEY,
    central_release,
    distributed_share,
    secure_aggregation_mod,
)
from dpfl.client.trainers import train_dpsgd, train_plain
from dpfl.config import RunConfig
from dpfl.data import ClientData, client_data
from dpfl.logs import get_logger, quiet_known_warnings, quiet_routine_flower_records
from dpfl.method import TRAIN_LOSS, ClientHalf
from dpfl.methods import method_for, parse_run_config
from dpfl.models.evaluation import device_for, evaluate_model
from dpfl.privacy.budget import BUDGET_REFUSAL, PrivacyHistory
from dpfl.privacy.ledger import prior_history, server_events_from
from dpfl.privacy.mechanisms import DpsgdRelease
from dpfl.privacy.plan import (
    EQUAL_WEIGHTS_CLAIM,
    UNCLIPPED_FRACTION,
    plan_from_record,
    plan_problem,
    planned_event,
)
from dpfl.privacy.randomness import mechanism_generator, public_seed
from dpfl.privacy.trust import (
    distributed_noise_multiplier,
    distributed_planned_event,
    own_noise,
    share_variance,
)
from dpfl.tensors import flatten, state_difference, unflatten

log = get_logger("flwr.dpfl.client")
# the known harmless third-party warnings and Flower's routine records logged as warnings,
# filtered precisely wherever this app runs (a deployment's SuperNode or SuperExec too, and
# the Ray actors of a simulation)
quiet_known_warnings()
quiet_routine_flower_records()
# SecAgg+ messages (trust=distributed) go through Flower's own secaggplus_mod
app = ClientApp(mods=[secure_aggregation_mod])


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


def _model(cfg: RunConfig, data: ClientData, arrays: ArrayRecord) -> torch.nn.Module:
    model = method_for(cfg).build_model(cfg, tuple(data.x_train.shape[1:]), data.num_classes)
    model.load_state_dict(arrays.to_torch_state_dict())
    return model


def _state_bytes(context: Context) -> int:
    """Bytes this node keeps between rounds (its privacy history, SecAgg+ keys, ...)."""
    return int(sum(record.count_bytes() for record in context.state.values()))


def _reply(msg: Message, **records) -> Message:
    return Message(RecordDict(records), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round of local training under the configured mechanism."""
    _threads()
    cfg = parse_run_config(context.run_config)
    config = msg.content["config"]
    server_round = int(config.get("server-round", 0))
    pid, nparts = _partition(context)
    data = client_data(cfg, pid, nparts)
    model = _model(cfg, data, msg.content["arrays"])
    received = {k: v.detach().clone() for k, v in model.state_dict().items()}
    device = device_for()
    # local shuffling of non-DP training: public seed (not part of any mechanism)
    shuffle_seed = public_seed(cfg.seed, pid, server_round)
    n = len(data.y_train)
    base = {"partition-id": pid, "server-round": server_round, "delta": cfg.delta}

    method = method_for(cfg)
    hooks = method.client.hooks(cfg, msg, context, model)
    if cfg.trainer == "plain":
        result = train_plain(model, data, cfg, shuffle_seed, device, hooks.post_step,
                             hooks.pre_step, hooks.step)
        update = state_difference(model.state_dict(), received)
        if is_canary(cfg, pid):
            update = unflatten(canary_update(cfg, pid, flatten(update)), received)
        metrics = {**base, "num-examples": n, "epsilon": float("inf"), "steps": result.steps}
        if cfg.report_train_loss:
            metrics["train-loss"] = result.train_loss
        return _reply(msg, arrays=ArrayRecord(update), metrics=MetricRecord(metrics),
                      privacy=ConfigRecord({"mechanism": "none"}))

    if cfg.trust == "central":
        return _central_round(msg, cfg, config, data, model, received, shuffle_seed, device,
                              {**base, "node-state-bytes": _state_bytes(context)}, hooks)

    history = PrivacyHistory.load(context.state, adaptive=method.adaptive)
    prior = prior_history(config, pid)
    if prior is not None and history.merge(prior):
        log.warning("client %d adopted privacy events recorded by the server (node state "
                    "was lost, e.g. after a restart)", pid)
        history.save(context.state)
    # the SuperNode's own durable copy (node-config privacy-dir): releases the server
    # never saw (a reply sent just before a SuperLink restart) stay counted
    node_file = history_path(context.node_config, cfg.run_name, context.run_id, pid)
    node_problem = None
    if node_file is not None:
        try:
            if adopt(history, node_file):
                log.warning("client %d adopted privacy events from its node's own record "
                            "%s that its run state lacked", pid, node_file)
                history.save(context.state)
        except NodeHistoryError as exc:
            node_problem = str(exc)
    dim = sum(int(v.numel()) for v in received.values())
    planned = (distributed_planned_event(cfg, server_round, dim, nparts)
               if cfg.trust == "distributed" else method.client.planned_event(cfg, n, server_round))
    if planned is None:
        planned = planned_event(cfg, n, server_round,
                                method.client.round_sigma(cfg, config, pid, model, n))
    eps_now = history.epsilon(cfg.delta, cfg.accountant)
    server_plan = plan_from_record(config, server_round)
    problem = plan_problem(planned, server_plan) if server_plan is not None else None
    # the budget covers the server's own releases charged to this client too (e.g. the
    # noisy count of adaptive clipping); the epsilon it reports stays its own events'
    try:
        released = server_events_from(config)
        spent = PrivacyHistory(history.events + released, history.adaptive)
        refuse, eps_after = spent.would_exceed(planned, cfg.target_epsilon, cfg.delta,
                                               cfg.accountant)
    except (TypeError, ValueError) as exc:  # malformed, or of another unit: never guess
        released, spent, refuse, eps_after = [], history, True, math.inf
        problem = problem or f"unusable server-event record ({exc})"
    reason = None
    if problem is not None:
        reason = f"plan: the server's plan differs from this client's ({problem})"
    elif node_problem is not None:
        reason = node_problem
    elif refuse:
        measure = "the Rényi filter's epsilon" if spent.adaptive else "epsilon"
        reason = (f"{BUDGET_REFUSAL}: {measure} would reach {eps_after:.4f} > target-epsilon "
                  f"{cfg.target_epsilon} (spent {spent.epsilon(cfg.delta, cfg.accountant):.4f}"
                  f" by the {cfg.accountant} accountant"
                  f"{', server releases included' if released else ''})")
    if reason is not None:
        log.warning("client %d refuses round %d: %s", pid, server_round, reason)
        return _reply(msg, metrics=MetricRecord({**base, "epsilon": eps_now, "refused": 1}),
                      status=ConfigRecord({"status": "refused", "reason": reason}))

    sigma = planned.sigma
    extra_metrics: dict[str, float] = {}
    noise_rng = mechanism_generator(cfg.reproducible, cfg.seed, pid, server_round, device)
    clip = method.client.round_clip(cfg, config)
    if cfg.trainer == "dpsgd":
        if hooks.pre_step is not None or hooks.step is not None:
            raise RuntimeError(f"strategy {cfg.strategy!r} changes the local step, which "
                               "Opacus owns under trainer=dpsgd")
        sampling_rng = (noise_rng if device.type == "cpu" else
                        mechanism_generator(cfg.reproducible, cfg.seed, pid, server_round))
        clip = method.client.sample_clip(cfg, config)
        count_std = method.client.unclipped_count_std(cfg, sigma)
        result = train_dpsgd(model, with_canary_examples(cfg, pid, nparts, data), cfg, sigma,
                             sampling_rng, noise_rng, device, hooks.post_step,
                             public_examples=n, clip=clip, noisy_grad=hooks.noisy_grad,
                             perturb=hooks.perturb, count_std=count_std)
        event = DpsgdRelease(sigma, result.sample_rate, result.steps).event(server_round)
        if result.unclipped_fraction is not None:  # released with the gradient (one Gaussian)
            extra_metrics[UNCLIPPED_FRACTION] = result.unclipped_fraction
        update = state_difference(model.state_dict(), received)
        # the method's post-processing of the DP-SGD output (free: it sees only that output)
        if type(method.client).post_process is not ClientHalf.post_process:
            processed = method.client.post_process(cfg, flatten(update), server_round)
            update = unflatten(processed, received)
        num_examples = n
    else:
        if hooks.noisy_grad is not None or hooks.perturb is not None:
            raise RuntimeError(f"strategy {cfg.strategy!r} sets DP-SGD-only hooks "
                               f"(noisy_grad, perturb) under trainer={cfg.trainer}")
        result = train_plain(model, data, cfg, shuffle_seed, device, hooks.post_step,
                             hooks.pre_step, hooks.step)
        raw = canary_update(cfg, pid, flatten(state_difference(model.state_dict(), received)))
        if device.type != "cpu":  # the flat update lives on the CPU: so must its noise
            noise_rng = mechanism_generator(cfg.reproducible, cfg.seed, pid, server_round)
        if cfg.trust == "distributed":
            if pid == cfg.secagg_drop_partition:
                raise RuntimeError(f"secagg-drop-partition={pid}: dropping out of SecAgg+ "
                                   "after sharing keys (fault injection)")
            n_min = int(config["secagg-n-min"])
            own = own_noise(cfg)
            if own is not None:   # the method's own quantiser and integer noise
                share = own.secure_share(cfg, raw, clip,
                                         distributed_noise_multiplier(cfg, dim, nparts),
                                         n_min, noise_rng, server_round)
            else:
                variance = share_variance(distributed_noise_multiplier(cfg, dim, nparts),
                                          cfg, n_min)
                share = distributed_share(raw, clip, cfg.secagg_scale, variance, noise_rng,
                                          cfg.secure_noise)
            event, update_metrics = planned, {}
            update = {"share": share}
        else:
            local = {TRAIN_LOSS: result.train_loss,
                     **method.client.local_values(cfg, config, model, data)}
            noisy, event, update_metrics = method.client.release_update(
                cfg, config, raw, sigma, clip, noise_rng, server_round, local)
            update = unflatten(noisy, received)
        # The data set size is private under client-level DP: aggregate with equal weights.
        # (A method that treats sizes as public derives them on the server itself.)
        num_examples = EQUAL_WEIGHTS_CLAIM
        extra_metrics = update_metrics
    del noise_rng
    history.charge(event)
    history.save(context.state)
    if node_file is not None:  # on disk before the release leaves (raises: nothing sent)
        record(history, node_file)
    eps = history.epsilon(cfg.delta, cfg.accountant)
    metrics = {**base, "num-examples": num_examples, "epsilon": eps, "noise-multiplier": sigma,
               "node-state-bytes": _state_bytes(context),
               "sample-rate": event.rate, "steps": event.steps, **extra_metrics}
    if cfg.report_train_loss:
        metrics["train-loss"] = result.train_loss
    privacy = PrivacyHistory([event], adaptive=history.adaptive).to_record()
    privacy["accountant"] = cfg.accountant
    privacy["clip"] = clip
    extras = hooks.finish(model, result)
    return _reply(msg, arrays=ArrayRecord(update), metrics=MetricRecord(metrics), privacy=privacy,
                  **extras)


def _central_round(msg: Message, cfg: RunConfig, config, data: ClientData,
                   model: torch.nn.Module, received, shuffle_seed: int, device, base,
                   hooks) -> Message:
    """trust=central: train, clip to the round's C, send the clipped update and the
    within-C bit to the trusted server (which adds the noise and charges everyone)."""
    result = train_plain(model, data, cfg, shuffle_seed, device, hooks.post_step,
                         hooks.pre_step, hooks.step)
    raw = flatten(state_difference(model.state_dict(), received))
    clip = float(config.get("central-clip", cfg.clip_norm))
    metrics = {**base, "num-examples": 1, "steps": result.steps}
    if clip > 0:
        clipped, metrics[UNCLIPPED_KEY] = central_release(raw, clip)
    else:  # central-impl=flower: Flower's wrapper clips on the server
        clipped = raw
    if cfg.report_train_loss:
        metrics["train-loss"] = result.train_loss
    return _reply(msg, arrays=ArrayRecord(unflatten(clipped, received)),
                  metrics=MetricRecord(metrics),
                  privacy=ConfigRecord({"mechanism": "none", "trust": "central", "clip": clip}),
                  **hooks.finish(model, result))


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Loss and accuracy of the received model on the client's local validation split.

    These metrics are computed from private data and released in the clear: they are not
    covered by the DP guarantee (keep ``fraction-evaluate = 0`` for a strictly DP run).
    """
    _threads()
    cfg = parse_run_config(context.run_config)
    pid, nparts = _partition(context)
    data = client_data(cfg, pid, nparts)
    model = _model(cfg, data, msg.content["arrays"])
    loss, preds = evaluate_model(model, data.x_val, data.y_val, device_for())
    n = len(data.y_val)
    acc = float((preds == data.y_val).float().mean()) if n else 0.0
    return _reply(msg, metrics=MetricRecord({"partition-id": pid, "num-examples": max(n, 1),
                                             "val-loss": loss, "val-accuracy": acc}))
