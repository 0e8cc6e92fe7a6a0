"""The learning-rate sweep behind conf/gcfl/*.toml (run once, before the grid).

DP-FedAvg, 2 IID MNIST clients, batch 32, C = 1.5, sigma calibrated to epsilon = 2 after 5
rounds; accuracy on the clients' held-out 10% validation splits (never the test set).
In-process (no Flower) for speed; the same dpfl trainer and accountant as the runs.

    for lr in 0.02 0.03 0.05 0.1; do python results/gcfl/lr_sweep.py lr=$lr; done
"""
import sys, time, torch, warnings
warnings.simplefilter("ignore")
from dpfl.config import RunConfig
from dpfl.data import client_data
from dpfl.models import build_model
from dpfl.privacy.plan import noise_multiplier_for
from dpfl.client.trainers import train_dpsgd, evaluate_model
from dpfl.tensors import flatten, unflatten, state_difference
torch.set_num_threads(1)
kw = dict(a.split("=") for a in sys.argv[1:])
base = RunConfig(dataset="mnist", batch_size=32, max_grad_norm=1.5, target_epsilon=2.0, num_rounds=5, val_fraction=0.1)
cfg = base.replace(**{k: type(getattr(base, k))(v) for k, v in kw.items()})
N = 2
data = [client_data(cfg, i, N) for i in range(N)]
xv = torch.cat([d.x_val for d in data]); yv = torch.cat([d.y_val for d in data])
torch.manual_seed(0)
model = build_model(cfg.model, (1, 28, 28), 10); g = model.state_dict()
t = time.time()
for r in range(1, cfg.num_rounds + 1):
    ups = []
    for i in range(N):
        sigma = noise_multiplier_for(cfg, len(data[i].y_train))
        m = build_model(cfg.model, (1, 28, 28), 10); m.load_state_dict(g)
        train_dpsgd(m, data[i], cfg, sigma, *[torch.Generator().manual_seed(r * 10 + i)] * 2,
                    torch.device("cpu"))  # public seeds: a probe, not a private release
        ups.append(flatten(state_difference(m.state_dict(), g)))
    g = unflatten(flatten(g) + torch.stack(ups).mean(0), g); model.load_state_dict(g)
    _, p = evaluate_model(model, xv, yv, torch.device("cpu"))
    print(kw, r, "val acc %.4f" % float((p == yv).float().mean()), "sigma %.3f" % sigma, "%.0fs" % (time.time() - t), flush=True)
