"""One release plan per method and round, used by both halves (dpfl.privacy.plan.ReleasePlan),
and the trust models' server halves as objects (dpfl.server.trust)."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord

from dpfl.methods import METHODS, build_strategy, run_config
from dpfl.privacy.plan import SHARED_PLAN, PlanInputs, ReleasePlan, planned_event, shared_plan
from dpfl.privacy.trust import OwnSecureNoise, distributed_planned_event
from dpfl.server.central import CentralAggregator
from dpfl.server.correlated import CorrelatedAggregator
from dpfl.server.trust import CentralTrust, DistributedTrust, LocalTrust, server_trust


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_strategy_plans_with_its_methods_plan(name):
    """The guard's plan is the method's function (not a second copy on the strategy)."""
    method = METHODS[name]
    cfg = run_config(strategy=name, trainer=method.trainers[0], server_holdout=100,
                     trust="distributed" if method.own_secure_noise else "local")
    assert build_strategy(cfg).plan_fn is method.plan


def test_own_secure_noise_is_declared_where_the_params_implement_it():
    for method in METHODS.values():
        implements = method.params is not None and issubclass(method.params, OwnSecureNoise)
        assert method.own_secure_noise == implements, method.name
    assert METHODS["cpsgd"].own_secure_noise


def test_the_shared_plan_is_the_runs_sigma_and_clip():
    """A method without a plan of its own: the event of dpfl.privacy.plan.planned_event at
    the run's sigma, C = clip-norm (update DP) or max-grad-norm (DP-SGD)."""
    for trainer, clip in (("update-dp", 0.7), ("dpsgd", 1.3)):
        cfg = run_config(trainer=trainer, noise_multiplier=1.1, clip_norm=0.7,
                         max_grad_norm=1.3)
        plan = shared_plan(cfg, PlanInputs(3, {}, 0, 120, 1000))
        assert plan is SHARED_PLAN and plan.round_clip(cfg) == clip
        assert plan.event_for(cfg, 120, 3) == planned_event(cfg, 120, 3)
    cfg = run_config(trainer="update-dp", noise_multiplier=1.1)
    assert ReleasePlan(sigma=2.0).event_for(cfg, 120, 3).sigma == 2.0


def test_the_server_plans_from_the_config_it_sent_and_the_client_from_the_one_it_got():
    """FedCompDP's C_t: the round's config as sent (recorded by send_config) is what the
    guard plans round t's replies from, after C moved on; the client's plan from the
    received ConfigRecord is the same."""
    cfg = run_config(strategy="fedcompdp", trainer="update-dp", clip_norm=2.0,
                     server_holdout=100)
    s = build_strategy(cfg, {0: 10, 1: 10})
    sent = s.send_config(1)
    s.clip = 0.5
    assert s.guard.planned_clip(1) == 2.0 and s.guard.planned_clip(2) == 0.5
    client = METHODS["fedcompdp"].plan(cfg, PlanInputs(1, ConfigRecord(sent), 0, 10, 0))
    assert client == s.release_plan(0, 1)


def test_trust_models_server_halves():
    local, central, distributed = (server_trust(run_config(trust=t, trainer="update-dp"))
                                   for t in ("local", "central", "distributed"))
    assert type(local) is LocalTrust and type(central) is CentralTrust
    assert type(distributed) is DistributedTrust
    assert local.clients_charge and distributed.clients_charge and not central.clients_charge
    assert distributed.secure_sum and not local.secure_sum and not central.secure_sum
    assert central.reply_keys == {"clip-unclipped"} and not local.reply_keys
    cfg = run_config(trust="central", trainer="update-dp", fraction_train=0.5)
    assert isinstance(central.aggregator(cfg, 10), CentralAggregator)
    assert local.aggregator(cfg, 10) is None
    tree = run_config(trust="central", trainer="update-dp", central_noise="tree", max_participations=1,
                      num_rounds=4)
    assert isinstance(central.aggregator(tree, 10), CorrelatedAggregator)
    dcfg = run_config(trust="distributed", trainer="update-dp", fraction_train=1.0, min_train_nodes=3,
                      noise_multiplier=1.0)
    assert distributed.planned_event(dcfg, SHARED_PLAN, 50, 2, 100, 5) == \
        distributed_planned_event(dcfg, 2, 100, 5)
    assert "secagg-n-min" in distributed.round_config(dcfg, 5)
