"""trust=central with correlated noise (central-noise=tree|banded-mf): the run-config keys,
the per-participation charge (checked by brute force over every pattern of small schemas
against the dense factorization), the aggregator's noise (the streaming generator's, i.e.
the dense B z), the schema enforced at selection and aggregation, the ledger charging only
participants, the guarantee naming the schema, a resume continuing the same stream."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from dpfl.config import ConfigError, RunConfig, validate
from dpfl.privacy.accounting.correlated_accounting import gram
from dpfl.privacy.accounting.events import history_epsilon
from dpfl.privacy.accounting.ledger import Ledger, client_key
from dpfl.privacy.accounting.participation import ParticipationSchema
from dpfl.privacy.correlated_charging import (
    correlated_charge,
    tree_pattern_sensitivities,
    tree_proportional_valid,
)
from dpfl.privacy.mechanisms.banded_mf import decoder_matrix, toeplitz_matrix
from dpfl.privacy.mechanisms.tree_aggregation import tree_factorization
from dpfl.privacy.verdict import guarantee_for
from dpfl.server.central import CentralAggregator
from dpfl.server.correlated import CorrelatedAggregator, cohort_size
from dpfl.server.nodes import NodeRegistry

from cli_helpers import fails

DELTA = 1e-5


def _cfg(**kw) -> RunConfig:
    base = dict(trainer="update-dp", trust="central", target_epsilon=4.0, num_rounds=6,
                reproducible=True)
    return validate(RunConfig(**{**base, **kw}))


# -- run-config ----------------------------------------------------------------------------

def test_default_is_todays_gaussian_central_mechanism():
    cfg = _cfg()
    assert cfg.central_noise == "gaussian"
    assert guarantee_for(cfg).sampling == "poisson"
    from dpfl.server.strategy import DPFLStrategy, StrategyInputs
    strategy = DPFLStrategy(cfg, inputs=StrategyInputs({i: 10 for i in range(4)}))
    assert type(strategy.central) is CentralAggregator


@pytest.mark.parametrize("changes,key", [
    (dict(central_noise="ftrl"), "central-noise"),
    (dict(central_noise="tree", trust="local"), "central-noise"),
    (dict(central_noise="tree", trust="distributed"), "central-noise"),
    (dict(central_noise="tree", central_impl="flower"), "central-noise"),
    (dict(central_noise="banded-mf", adaptive_clip=True), "adaptive-clip"),
    (dict(central_noise="tree", max_participations=3, min_separation=3), "max-participations"),
    (dict(central_noise="banded-mf", max_participations=2, min_separation=2,
          central_band=3), "central-band"),
    (dict(central_noise="tree", central_band=2), "central-band"),
    (dict(central_noise="banded-mf", tree_restart=2), "tree-restart"),
    (dict(max_participations=2), "max-participations"),
    (dict(min_separation=2), "min-separation"),
    (dict(central_noise="tree", max_participations=0), "max-participations"),
    (dict(central_noise="tree", resume=True, resume_without_checkpoint=True),
     "resume-without-checkpoint"),
])
def test_bad_combinations_stop_the_run_naming_the_key(changes, key):
    with pytest.raises(ConfigError) as err:
        _cfg(**changes)
    message = str(err.value)
    assert message.startswith(f"run-config key '{key}'") and "\n" not in message


@pytest.mark.parametrize("argv,named", [
    (["trainer=update-dp", "central-noise=tree"],
     ["run-config key 'central-noise'", "needs trust=central"]),
    (["trainer=update-dp", "trust=distributed", "central-noise=banded-mf"],
     ["run-config key 'central-noise'", "needs trust=central", "other cohorts added"]),
    (["trainer=update-dp", "trust=central", "central-noise=banded-mf", "num-rounds=4",
      "max-participations=3", "min-separation=2"],
     ["run-config key 'max-participations'", "num-rounds is 4"]),
    (["trainer=update-dp", "trust=central", "central-noise=tree", "adaptive-clip=true"],
     ["run-config key 'adaptive-clip'"]),
])
def test_bad_keys_exit_2_with_one_line_before_anything_starts(tmp_path, capsys, argv, named):
    fails(capsys, ["simulate", "--output-dir", str(tmp_path), *argv], *named)
    assert not any(tmp_path.iterdir())


# -- charging: an upper bound for every pattern, exact for the worst ---------------------

def _pattern_sens2(encoder: np.ndarray, pattern: tuple[int, ...]) -> float:
    """sens(pi)^2 of C on one pattern: sum |X_ij| over pi (exact when X >= 0 on pi, or
    zero off the diagonal on pi: both hold for the tree and banded C under the schema)."""
    x = gram(encoder)[np.ix_(pattern, pattern)]
    assert np.all(x >= -1e-12) or np.allclose(x - np.diag(np.diag(x)), 0, atol=1e-12)
    return float(np.abs(x).sum())


def _charged2(charge, pattern: tuple[int, ...]) -> float:
    """sum of 1 / z^2 over the events the pattern's participations are charged, x sigma^2."""
    total = 0.0
    for prior, t in enumerate(pattern):
        for e in charge.charges(t + 1, prior):
            total += (charge.noise_std / e.sigma) ** 2
    return total


SCHEMAS = [(6, 1, 1), (6, 2, 2), (7, 2, 3), (8, 3, 2), (8, 2, 4), (9, 3, 3), (10, 4, 2),
           (12, 3, 4), (5, 5, 1)]


@pytest.mark.parametrize("n,k,b", SCHEMAS)
@pytest.mark.parametrize("mode", ["tree", "banded-mf"])
def test_charge_bounds_every_pattern_and_is_exact_for_the_worst(mode, n, k, b):
    cfg = _cfg(central_noise=mode, num_rounds=n, max_participations=k, min_separation=b)
    charge = correlated_charge(cfg)
    schema = ParticipationSchema(n, k, b)
    encoder = (tree_factorization(n).encoder if mode == "tree" else
               toeplitz_matrix(charge.coefficients, n))
    worst = 0.0
    for pattern in schema.patterns():
        sens2 = _pattern_sens2(encoder, pattern)
        charged = _charged2(charge, pattern)
        assert charged >= sens2 * (1 - 1e-9), (pattern, charged, sens2)
        if mode == "banded-mf":   # each client's own mechanism exactly
            assert charged == pytest.approx(sens2, rel=1e-9)
        worst = max(worst, sens2)
    assert charge.sensitivity == pytest.approx(math.sqrt(worst), rel=1e-9)
    most = max(_charged2(charge, p) for p in schema.patterns())
    assert most == pytest.approx(worst, rel=1e-9)   # the worst client: exactly sens_k


def test_banded_with_whole_columns_is_the_proportional_charge():
    """band <= separation, columns whole: k' participations cost (k' / k) sens_k^2."""
    charge = correlated_charge(_cfg(central_noise="banded-mf", num_rounds=12,
                                    max_participations=3, min_separation=4))
    band = len(charge.coefficients)
    for t in range(1, 12 - band + 2):
        assert charge.weights2[t - 1] == pytest.approx(charge.sensitivity ** 2 / 3, rel=1e-9)


def test_proportional_charging_is_no_bound_for_some_tree_schemas():
    """Why the tree falls back to the whole run at the first participation: brute force
    finds schemas where sens_m^2 > (m / k) sens_k^2."""
    failing = []
    for n, k, b in [(16, 2, 8), (10, 2, 5), (100, 10, 10), (12, 3, 4)]:
        schema = ParticipationSchema(n, k, b)
        sens = tree_pattern_sensitivities(schema)
        if n <= 16:   # the DP's sens_m against brute force
            enc = tree_factorization(n).encoder
            for m in range(1, k + 1):
                sub = dataclasses.replace(schema, max_participations=m)
                brute = max(_pattern_sens2(enc, p) for p in sub.patterns())
                assert sens[m - 1] ** 2 == pytest.approx(brute, rel=1e-9)
        if not tree_proportional_valid(sens):
            failing.append((n, k, b))
            charge = correlated_charge(_cfg(central_noise="tree", num_rounds=n,
                                            max_participations=k, min_separation=b))
            assert charge.first_only and not charge.proportional_exact
            assert charge.charges(5, 1) == []
    assert failing


def test_max_participation_client_epsilon_is_dp_accountings_gaussian_at_sigma_over_sens():
    for mode in ("tree", "banded-mf"):
        cfg = _cfg(central_noise=mode, num_rounds=8, max_participations=2, min_separation=4)
        charge = correlated_charge(cfg)
        events = [e for prior, t in enumerate((1, 5)) for e in charge.charges(t, prior)]
        z = charge.noise_std / charge.sensitivity
        expected = pld_privacy_accountant.PLDAccountant().compose(
            dp_event.GaussianDpEvent(z)).get_epsilon(DELTA)
        assert history_epsilon(events, DELTA, "pld") == pytest.approx(expected, rel=1e-3)
        rdp = rdp_privacy_accountant.RdpAccountant().compose(
            dp_event.GaussianDpEvent(z)).get_epsilon(DELTA)
        assert history_epsilon(events, DELTA, "rdp") == pytest.approx(rdp, rel=1e-6)
        assert history_epsilon(events, DELTA, "pld") <= cfg.target_epsilon * (1 + 1e-3)


# -- the aggregator --------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["tree", "banded-mf"])
def test_aggregator_noise_is_the_streaming_generators_dense_b_z(mode):
    n, dim = 7, 5
    cfg = _cfg(central_noise=mode, num_rounds=n, max_participations=2, min_separation=3,
               clip_norm=0.5, fraction_train=0.5)
    agg = CorrelatedAggregator(cfg, 4)
    m = cohort_size(cfg, 4)
    assert m == 2 and agg.denominator == 2.0
    gen = torch.Generator().manual_seed(int(agg.generator.initial_seed()))
    if mode == "tree":
        fact = tree_factorization(n)
        decoder = fact.decoder
        z = torch.stack([torch.randn(dim, generator=gen, dtype=torch.float64)
                         for _ in range(fact.encoder.shape[0])])
    else:
        decoder = decoder_matrix(agg.charge.coefficients, n)
        z = torch.stack([torch.randn(dim, generator=gen, dtype=torch.float64)
                         for _ in range(n)])
    prefix = torch.from_numpy(decoder) @ z
    released = torch.zeros(dim, dtype=torch.float64)
    for t in range(1, n + 1):
        released += agg.release(t, torch.zeros((0, dim), dtype=torch.float64))
        scaled = released * m / (agg.sigma * cfg.clip_norm)
        torch.testing.assert_close(scaled, prefix[t - 1], rtol=1e-9, atol=1e-9)


def test_release_adds_the_clipped_sum_over_the_cohort_size():
    cfg = _cfg(central_noise="tree", num_rounds=2, clip_norm=1.0, fraction_train=0.5,
               noise_multiplier=1e-12)
    agg = CorrelatedAggregator(cfg, 4)
    out = agg.release(1, torch.tensor([[3.0, 4.0], [0.3, 0.4]], dtype=torch.float64))
    torch.testing.assert_close(out, torch.tensor([0.45, 0.6], dtype=torch.float64))


def test_selection_never_picks_a_client_outside_the_schema_and_only_participants_pay():
    n, clients = 8, 6
    cfg = _cfg(central_noise="banded-mf", num_rounds=n, max_participations=2,
               min_separation=3, fraction_train=0.34)
    agg = CorrelatedAggregator(cfg, clients)
    registry = NodeRegistry()
    nodes = [100 + i for i in range(clients)]
    for i, node in enumerate(nodes):
        registry.node_client[node] = client_key(i)
    ledger = Ledger(delta=DELTA, accountant="pld")
    for t in range(1, n + 1):
        chosen = agg.select(t, nodes, registry)
        assert len(chosen) <= cohort_size(cfg, clients)
        pids = [node - 100 for node in chosen]
        for pid in pids:
            assert agg.refusal(client_key(pid), t) is None
        taken, refused = agg.admit(pids, t)
        assert not refused and taken == list(range(len(pids)))
        for events, group in agg.participation_charges(t, pids):
            ledger.charge_server_release(t, events, [client_key(p) for p in group])
    schema = agg.schema
    for client, rounds in agg.participations.items():
        assert schema.is_feasible([r - 1 for r in rounds])
        assert sorted(ledger.rounds(client)) == rounds
        assert ledger.epsilon(client) <= cfg.target_epsilon * (1 + 1e-3)
    charged = {c for c in ledger.clients if ledger.history(c).events}
    assert charged == set(agg.participations)
    # a client that has its k participations is refused at aggregation too
    full = next(c for c, r in agg.participations.items() if len(r) == 2)
    pid = int(full.split("-")[1])
    taken, refused = agg.admit([pid], n)
    assert taken == [] and "outside the participation schema" in refused[0]


def test_admit_refuses_a_client_twice_in_one_round_and_a_too_close_one():
    cfg = _cfg(central_noise="tree", num_rounds=6, max_participations=2, min_separation=3)
    agg = CorrelatedAggregator(cfg, 4)
    taken, refused = agg.admit([0, 0, 1], 1)
    assert taken == [0, 2] and "another node" in refused[1]
    taken, refused = agg.admit([0, 2], 2)
    assert taken == [1] and "at least 3" in refused[0]
    assert agg.participations == {"client-0": [1], "client-1": [1], "client-2": [2]}


def test_guarantee_states_the_schema_in_place_of_poisson():
    for mode in ("tree", "banded-mf"):
        cfg = _cfg(central_noise=mode, num_rounds=6, max_participations=2, min_separation=3)
        g = guarantee_for(cfg)
        assert g.sampling == "none" and g.relation == "add-remove"
        assert ParticipationSchema(6, 2, 3).statement() in g.scope
        assert "Poisson" not in g.scope and "poisson" not in g.scope


@pytest.mark.parametrize("mode", ["tree", "banded-mf"])
def test_state_dict_resumes_the_same_noise_stream(mode):
    n, dim = 8, 3
    cfg = _cfg(central_noise=mode, num_rounds=n, max_participations=2, min_separation=4,
               reproducible=False)
    first = CorrelatedAggregator(cfg, 4)
    zeros = torch.zeros((0, dim), dtype=torch.float64)
    first.admit([0, 1], 1)
    outs = [first.release(t, zeros) for t in range(1, 4)]
    state = first.state_dict()
    after = [first.release(t, zeros) for t in range(4, n + 1)]
    second = CorrelatedAggregator(cfg, 4)
    second.load_state_dict(state)
    assert second.participations == {"client-0": [1], "client-1": [1]}
    again = [second.release(t, zeros) for t in range(4, n + 1)]
    for a, b in zip(after, again):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert outs
    # a stream asked for the wrong round refuses (a resume that lost its checkpoint)
    third = CorrelatedAggregator(cfg, 4)
    with pytest.raises(RuntimeError, match="stream is at 0"):
        third.release(4, zeros)


def test_correlated_central_strategy_round_refuses_and_charges_participants_only():
    """The strategy's round: the aggregator is chosen by central-noise, an update of a
    client beyond its k is refused and never charged."""
    from dpfl.server.strategy import DPFLStrategy, RoundRecord, StrategyInputs
    from dpfl.server.validation import ClientUpdate, array_template
    cfg = _cfg(central_noise="tree", num_rounds=4, max_participations=1, fraction_train=0.5)
    ledger = Ledger(delta=DELTA, accountant="pld")
    strategy = DPFLStrategy(cfg, inputs=StrategyInputs({i: 10 for i in range(4)},
                                                       ledger=ledger))
    assert isinstance(strategy.central, CorrelatedAggregator)
    from flwr.app import ArrayRecord
    arrays = ArrayRecord({"w": torch.zeros(3)})
    strategy._global = arrays
    strategy._template = array_template(arrays)
    for rnd, pids in ((1, [0, 1]), (2, [1, 2])):
        record = RoundRecord(rnd, sampled=[10 + p for p in pids])
        record.accepted = [ClientUpdate(10 + p, p, torch.full((3,), 0.1), 10, {})
                           for p in pids]
        out = strategy._central_outcome(rnd, record, 3)
        assert out.arrays is not None
    assert [r.partition_id for r in record.rejected] == [1]
    assert record.rejected[0].kind == "refused"
    charged = {c: ledger.rounds(c) for c in ledger.clients if ledger.history(c).events}
    assert charged == {"client-0": [1], "client-1": [1], "client-2": [2]}


# -- which methods run over it (issue 49, item 4) -----------------------------------------

LINEAR_SERVER_STEPS = {"dpfedavg", "dpfedavgm", "dpfedprox", "dpfedsam", "fedacg"}


@pytest.mark.parametrize("noise", ["tree", "banded-mf"])
def test_every_method_with_a_central_server_runs_over_correlated_noise(noise):
    """Correlated noise is DP for any server step (post-processing), and DP-FTRL's accuracy
    argument needs a server step linear in the released sums: SGD at server-lr (dpfedavg,
    dpfedprox, dpfedsam), heavy-ball momentum (dpfedavgm), FedACG's momentum and lookahead.
    Those are exactly the methods that run under trust=central; every other method's server
    logic reads individual updates (trust=local or distributed only) and is refused by its
    trust, naming the key."""
    from dpfl.methods import METHODS, configured

    central = {name for name, m in METHODS.items() if "central" in m.trusts}
    assert central == LINEAR_SERVER_STEPS
    for name in sorted(METHODS):
        cfg = configured(_cfg(strategy=name, central_noise=noise, max_participations=2,
                              min_separation=2))
        if name in central:
            METHODS[name].check(cfg)   # the method's own rules (parse_run_config's)
        else:
            with pytest.raises(ConfigError) as err:
                METHODS[name].check(cfg)
            # by its trust (or, before it, the trainer it needs, which central cannot run)
            assert str(err.value).startswith(("run-config key 'trust'",
                                              "run-config key 'trainer'")), name


# -- a resume continues the same stream (its num-rounds fixed) ------------------------------

def test_a_resume_may_not_change_the_rounds_correlated_noise_was_built_for():
    """C, the schema's sensitivity and sigma are computed for the run's num-rounds; a
    resume continues the same noise stream, so it keeps them (a Poisson central run may
    still go on for more rounds: its budget check bounds what it spends)."""
    from dpfl.server.runidentity import check_resume, resume_overrides

    saved = {**RunConfig(trainer="update-dp", trust="central", central_noise="banded-mf",
                         num_rounds=4, max_participations=2, min_separation=2).to_dict(),
             "num-clients": 4}
    with pytest.raises(ConfigError) as err:
        resume_overrides(saved, {"num-rounds": 6, "resume": True}, "runs/x")
    message = str(err.value)
    assert message.startswith("run-config key 'num-rounds'") and "\n" not in message
    assert "central-noise=banded-mf was built for 4 rounds" in message
    check_resume(saved, {"num-rounds": 4, "round-timeout": 99}, "runs/x")   # the rest may
    poisson = {**saved, "central-noise": "gaussian"}
    check_resume(poisson, {"num-rounds": 6}, "runs/x")
