"""A client's own privacy budget across rounds, enforced before it trains.

The history lives in the node's run state; the server's copy (``ledger-*`` keys of the
instruction) and the SuperNode's durable file (node-config ``privacy-dir``) are adopted
when the state lacks events they hold, so a lost state never lets a client spend twice.
A round is refused (nothing trained, nothing spent) when the server's plan differs from
the client's, the node's record is unusable, or the planned event would take the client
over ``target-epsilon`` (the server's own releases charged to it included).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

from flwr.app import ConfigRecord, RecordDict

from dpfl.client.job import ClientJob
from dpfl.client.node_history import NodeHistoryError, adopt, history_path, record
from dpfl.logs import get_logger
from dpfl.privacy.accounting.budget import BUDGET_REFUSAL, PrivacyHistory
from dpfl.privacy.accounting.events import PrivacyEvent
from dpfl.privacy.accounting.ledger import prior_history, server_events_from
from dpfl.privacy.plan import plan_from_record, plan_problem

log = get_logger("flwr.dpfl.client")


class ClientBudget:
    """Client ``job.pid``'s history, opened from ``state`` (adopting the server's and the
    node file's events it lacks)."""

    def __init__(self, job: ClientJob, state: RecordDict, node_config: Mapping[str, Any],
                 run_id: int, adaptive: bool) -> None:
        self.job, self.state = job, state
        cfg, pid = job.cfg, job.pid
        self.history = PrivacyHistory.load(state, adaptive=adaptive)
        # a ledger record this client cannot read: it refuses the round (never guesses)
        self.record_problem: str | None = None
        try:
            prior = prior_history(job.config, pid)
        except (TypeError, ValueError) as exc:
            prior, self.record_problem = None, f"unusable ledger record ({exc})"
        if prior is not None and self.history.merge(prior):
            log.warning("client %d adopted privacy events recorded by the server (node state "
                        "was lost, e.g. after a restart)", pid)
            self.history.save(state)
        # the SuperNode's own durable copy: releases the server never saw (a reply sent
        # just before a SuperLink restart) stay counted
        self.node_file: Path | None = history_path(node_config, cfg.run_name, run_id, pid)
        self.node_problem: str | None = None
        if self.node_file is not None:
            try:
                if adopt(self.history, self.node_file):
                    log.warning("client %d adopted privacy events from its node's own record "
                                "%s that its run state lacked", pid, self.node_file)
                    self.history.save(state)
            except NodeHistoryError as exc:
                self.node_problem = str(exc)

    def epsilon(self) -> float:
        cfg = self.job.cfg
        return self.history.epsilon(cfg.delta, cfg.accountant)

    def refusal(self, planned: PrivacyEvent) -> str | None:
        """Why this client must not release ``planned`` (None: it may), logged."""
        job, cfg = self.job, self.job.cfg
        try:
            server_plan = plan_from_record(job.config, job.server_round)
            problem = plan_problem(planned, server_plan) if server_plan is not None else None
        except (TypeError, ValueError) as exc:
            problem = f"unusable plan record ({exc})"
        # the budget covers the server's own releases charged to this client too (e.g. the
        # noisy count of adaptive clipping); the epsilon it reports stays its own events'
        try:
            released = server_events_from(job.config)
            spent = PrivacyHistory(self.history.events + released, self.history.adaptive)
            refuse, eps_after = spent.would_exceed(planned, cfg.target_epsilon, cfg.delta,
                                                   cfg.accountant)
        except (TypeError, ValueError) as exc:  # malformed, or of another unit: never guess
            released, spent, refuse, eps_after = [], self.history, True, math.inf
            problem = problem or f"unusable server-event record ({exc})"
        reason = None
        if problem is not None:
            reason = f"plan: the server's plan differs from this client's ({problem})"
        elif self.record_problem is not None:
            reason = self.record_problem
        elif self.node_problem is not None:
            reason = self.node_problem
        elif refuse:
            measure = "the Rényi filter's epsilon" if spent.adaptive else "epsilon"
            reason = (f"{BUDGET_REFUSAL}: {measure} would reach {eps_after:.4f} > "
                      f"target-epsilon {cfg.target_epsilon} (spent "
                      f"{spent.epsilon(cfg.delta, cfg.accountant):.4f} by the "
                      f"{cfg.accountant} accountant"
                      f"{', server releases included' if released else ''})")
        if reason is not None:
            log.warning("client %d refuses round %d: %s", job.pid, job.server_round, reason)
        return reason

    def charge(self, event: PrivacyEvent) -> None:
        """Spend ``event``: in the run state, and on the node's disk before the release
        leaves (raises: nothing is sent)."""
        self.history.charge(event)
        self.history.save(self.state)
        if self.node_file is not None:
            record(self.history, self.node_file)

    def privacy_record(self, event: PrivacyEvent, clip: float) -> ConfigRecord:
        """The reply's ``privacy`` record: this round's event, the accountant, the clip."""
        privacy = PrivacyHistory([event], adaptive=self.history.adaptive).to_record()
        privacy["accountant"] = self.job.cfg.accountant
        privacy["clip"] = clip
        return privacy
