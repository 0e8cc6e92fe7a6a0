"""What a membership-inference attacker of a finished dpfl run attacks: the target
client's records (members), records of the same distribution that no client held
(non-members, equal in number) and the attacker's own disjoint records (the population for
shadow and reference models), and the models: the final global model (``checkpoint.pt``)
and the target client's last update as the server received it (``updates/client-<i>.pt``,
kept when the run had ``record-updates`` > i), i.e. the model the server can rebuild,
global + update: the strongest attacker of the local trust model; and, for CS-MIA, the
global model of every round (``globals/round-<r>.pt``, kept when the run had
``record-global-models = true``) with the adversary's own labelled records: another
client's training records (in the federation) and population records (outside it).

Everything is rebuilt from ``config.json`` (the partitions are a deterministic function of
it) and is the same for the same run directory and seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch
from torch import nn

from dpfl.client.canary import is_canary
from dpfl.config import RunConfig
from dpfl.data import (
    load_dataset,
    server_holdout_indices,
    splits_for,
    to_tensor,
    training_pool,
)
from dpfl.errors import UserError, read_json_file
from dpfl.methods import method_for, parse_run_config
from dpfl.privacy.audit.canaries import canary_bits
from dpfl.server.observer import (
    recorded_global_path,
    recorded_global_rounds,
    recorded_update_path,
)
from dpfl.tensorfile import UnsafeTensorFile, load_tensors
from dpfl.tensors import unflatten

Records = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class AttackData:
    """Members, non-members and population records of one target client."""

    client: int
    members: Records
    nonmembers: Records
    population: Records
    nonmember_source: str   # "training examples no client held" or "test set"


@dataclass
class TargetModel:
    """One model to attack and the state its shadow training starts from."""

    name: str               # "global" | "update"
    model: nn.Module
    start: dict[str, torch.Tensor] | None   # shadow models start here (None: fresh init)
    note: str


def run_config(run_dir: Path) -> tuple[RunConfig, int]:
    """The run's configuration and number of clients from ``config.json``."""
    raw = dict(read_json_file(run_dir / "config.json", "run configuration"))
    num_clients = int(raw.pop("num-clients", 0))
    if num_clients < 1:
        raise UserError(f"{run_dir / 'config.json'}: no 'num-clients' (not a finished run)")
    return parse_run_config(raw), num_clients


def _take(ds, idx: np.ndarray, train: bool) -> Records:
    x, y = (ds.x_train, ds.y_train) if train else (ds.x_test, ds.y_test)
    return to_tensor(ds.name, x[idx]), torch.from_numpy(y[idx]).long()


def attack_data(cfg: RunConfig, num_clients: int, client: int, seed: int,
                max_members: int = 1000, population: int = 4000) -> AttackData:
    """The target's training records (at most ``max_members``, seeded sample), as many
    non-members, and up to ``population`` attacker records, all disjoint. Non-members and
    population come from training examples outside every client's partition (and outside
    the server's holdout) when there are enough of them, else from the test set."""
    if not 0 <= client < num_clients:
        raise UserError(f"--client {client}: the run has clients 0..{num_clients - 1}")
    ds = load_dataset(cfg.dataset, cfg.data_dir, cfg.download)
    rng = np.random.default_rng(seed)
    members = splits_for(cfg, num_clients)[client].train
    if len(members) > max_members:
        members = np.sort(rng.choice(members, max_members, replace=False))
    n = len(members)
    pool = training_pool(len(ds.y_train), cfg.server_holdout, cfg.train_subset, cfg.seed)
    held = server_holdout_indices(len(ds.y_train), cfg.server_holdout, cfg.seed)
    outside = np.setdiff1d(np.arange(len(ds.y_train)), np.union1d(pool, held))
    if len(outside) >= 2 * n:
        source, train, candidates = "training examples no client held", True, outside
    else:
        source, train, candidates = "test set", False, np.arange(len(ds.y_test))
    if len(candidates) < 2 * n:
        raise UserError(f"client {client} holds {n} records but only {len(candidates)} "
                        "non-member records exist: lower --max-members")
    order = rng.permutation(candidates)
    return AttackData(client, _take(ds, members, True), _take(ds, order[:n], train),
                      _take(ds, order[n:n + population], train), source)


def target_models(run_dir: Path, cfg: RunConfig, client: int, input_shape: tuple[int, ...],
                  num_classes: int) -> list[TargetModel]:
    """The final global model, and the client's recorded update (when kept) applied to
    the global model it started from."""
    method = method_for(cfg)

    def build() -> nn.Module:
        return method.build_model(cfg, tuple(input_shape), num_classes)

    path = run_dir / "checkpoint.pt"
    try:
        checkpoint = load_tensors(path)
        state = checkpoint["model"]
    except UnsafeTensorFile as exc:
        raise UserError(str(exc)) from None
    except (OSError, EOFError, RuntimeError, KeyError, TypeError) as exc:
        raise UserError(f"{path}: no usable model checkpoint ({exc})") from exc
    final = build()
    final.load_state_dict(state)
    out = [TargetModel("global", final, None,
                       f"final global model after round {checkpoint.get('round')}")]
    upd_path = recorded_update_path(run_dir, client)
    if released_canary(cfg, client):
        out[0].note += (f"; client {client}'s update is not attacked: in this audit run it "
                        "released its canary instead of training")
    elif upd_path.exists():
        try:
            rec = load_tensors(upd_path)
            start = unflatten(rec["global"], state)
            local = unflatten(rec["global"] + rec["update"], state)
        except UnsafeTensorFile as exc:
            raise UserError(str(exc)) from None
        except (OSError, EOFError, RuntimeError, KeyError, TypeError) as exc:
            raise UserError(f"{upd_path}: damaged recorded update ({exc})") from exc
        model = build()
        model.load_state_dict(local)
        out.append(TargetModel("update", model, dict(start),
                               f"client {client}'s update of round {rec['round']} as the "
                               "server received it, applied to that round's global model"))
    return out


def released_canary(cfg: RunConfig, client: int) -> bool:
    """Whether ``client`` is a canary client of an audit run whose coin came up 1 (its
    updates were its canary vector, not training on its records)."""
    return (is_canary(cfg, client)
            and bool(canary_bits(cfg.audit_seed, cfg.audit_canaries)[client]))


def model_factory(build: Callable[[], nn.Module], start: dict[str, torch.Tensor] | None
                  ) -> Callable[[], nn.Module]:
    """Fresh models for shadow / reference training, starting at ``start`` when given."""
    def make() -> nn.Module:
        model = build()
        if start is not None:
            model.load_state_dict(start)
        return model
    return make


def attacker_records(cfg: RunConfig, num_clients: int, attacker: int, seed: int,
                     population: Records, max_members: int = 1000) -> tuple[Records, Records]:
    """CS-MIA's labelled records: client ``attacker``'s training records (at most
    ``max_members``, seeded sample; members the adversary knows) and as many records of
    the attacker's ``population`` (no client held them: known non-members), drawn with the
    members' label counts where the population has enough of each label (CHOICE: under a
    label-skewed partition the attack model would otherwise learn the attacker's label mix,
    not membership), the rest uniformly."""
    if not 0 <= attacker < num_clients:
        raise UserError(f"--csmia-attacker {attacker}: the run has clients "
                        f"0..{num_clients - 1}")
    ds = load_dataset(cfg.dataset, cfg.data_dir, cfg.download)
    rng = np.random.default_rng([seed, attacker])
    own = splits_for(cfg, num_clients)[attacker].train
    n = min(len(own), max_members, len(population[1]))
    if n < 1:
        raise UserError(f"client {attacker} holds no training records for CS-MIA")
    own = np.sort(rng.choice(own, n, replace=False))
    members = _take(ds, own, True)
    outside = torch.from_numpy(np.sort(label_matched(members[1].numpy(),
                                                     population[1].numpy(), rng)))
    return members, (population[0][outside], population[1][outside])


def label_matched(labels: np.ndarray, pool: np.ndarray, rng: np.random.Generator
                  ) -> np.ndarray:
    """len(labels) distinct indices into ``pool`` with, label by label, as many of each
    label as ``labels`` has (all of that label when the pool has fewer), topped up with
    uniformly drawn other indices."""
    chosen: list[int] = []
    for label, count in zip(*np.unique(labels, return_counts=True)):
        where = np.flatnonzero(pool == label)
        chosen += rng.choice(where, min(count, len(where)), replace=False).tolist()
    rest = np.setdiff1d(np.arange(len(pool)), chosen)
    missing = min(len(labels) - len(chosen), len(rest))
    chosen += rng.choice(rest, missing, replace=False).tolist()
    return np.asarray(chosen, dtype=np.int64)


def global_models(run_dir: Path, cfg: RunConfig, input_shape: tuple[int, ...],
                  num_classes: int) -> tuple[list[int], Callable[[], Iterable[nn.Module]]]:
    """The rounds whose global model the run kept (``record-global-models``) and a
    function yielding those models one at a time, in round order."""
    rounds = recorded_global_rounds(run_dir)
    build = method_for(cfg).build_model

    def models() -> Iterable[nn.Module]:
        for r in rounds:
            path = recorded_global_path(run_dir, r)
            try:
                state = load_tensors(path)["model"]
            except UnsafeTensorFile as exc:
                raise UserError(str(exc)) from None
            except (OSError, EOFError, RuntimeError, KeyError, TypeError) as exc:
                raise UserError(f"{path}: damaged recorded global model ({exc})") from exc
            model = build(cfg, tuple(input_shape), num_classes)
            model.load_state_dict(state)
            yield model.eval()
    return rounds, models
