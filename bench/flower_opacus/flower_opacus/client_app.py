"""The ClientApp: Opacus' PrivacyEngine around the model, optimizer and loader, one local
epoch of DP-SGD (Poisson sampling, per-sample clipping), the trained weights back."""

from __future__ import annotations

import logging
import warnings

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from opacus import PrivacyEngine
from torch.utils.data import DataLoader, TensorDataset

from flower_opacus.task import Net, partition

warnings.filterwarnings("ignore", category=UserWarning)
logging.getLogger("opacus").setLevel(logging.ERROR)

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg = context.run_config
    torch.set_num_threads(1)
    x, y = partition(str(cfg["data"]), int(context.node_config["partition-id"]))
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=float(cfg["lr"]))
    loader = DataLoader(TensorDataset(x, y), batch_size=int(cfg["batch-size"]), shuffle=True)
    engine = PrivacyEngine(secure_mode=False)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader,
        noise_multiplier=float(cfg["noise-multiplier"]),
        max_grad_norm=float(cfg["max-grad-norm"]))
    criterion = torch.nn.CrossEntropyLoss()
    model.train()
    for xb, yb in loader:
        if len(yb) == 0:
            continue
        optimizer.zero_grad()
        criterion(model(xb), yb).backward()
        optimizer.step()
    state = {k.removeprefix("_module."): v for k, v in model.state_dict().items()}
    return Message(RecordDict({"arrays": ArrayRecord(state),
                               "metrics": MetricRecord({"num-examples": len(y)})}),
                   reply_to=msg)
