"""The ServerApp: Flower's FedAvg over every node each round, the global model evaluated
centrally on the test set before round 1 and after every round (as dpfl's demo does)."""

from __future__ import annotations

import json

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from flower_opacus.task import Net, test_set

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    torch.manual_seed(int(cfg["seed"]))
    x_test, y_test = test_set(str(cfg["data"]))
    history: list[float] = []

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model = Net()
        model.load_state_dict(arrays.to_torch_state_dict())
        model.eval()
        with torch.no_grad():
            correct = sum(int((model(x_test[i:i + 1000]).argmax(1) == y_test[i:i + 1000]).sum())
                          for i in range(0, len(y_test), 1000))
        history.append(correct / len(y_test))
        return MetricRecord({"accuracy": correct / len(y_test)})

    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()),
                   num_rounds=int(cfg["num-server-rounds"]), evaluate_fn=evaluate)
    print("FLOWER-OPACUS-RESULT " + json.dumps({"accuracy": history}), flush=True)
