"""``dpfedavg``: DP-FedAvg in its two forms, chosen by the run-config ``trainer``.

- ``trainer=dpsgd`` (sample-level): clients run Opacus DP-SGD (Abadi et al., "Deep Learning
  with Differential Privacy", CCS 2016); the server averages the updates weighted by sample
  counts. Averaging is post-processing.
- ``trainer=update-dp`` (client-level): each client clips its whole update to C and adds
  N(0, sigma^2 C^2) (the Gaussian mechanism of McMahan, Ramage, Talwar & Zhang, "Learning
  Differentially Private Recurrent Language Models", ICLR 2018, applied client-side;
  accounted under replace-one, see ``dpfl.privacy.plan``).

Everything private — equal weights for client-level DP, the norm bound on replies, the
ledger charges — comes from the DP guard every strategy carries (``dpfl.server.guard``):
the server half of DP-FedAvg is the shared base strategy itself.
"""

from __future__ import annotations

from dpfl.config import TRUSTS as ALL_TRUSTS
from dpfl.method import Method
from dpfl.server.strategy import DPFLStrategy

METHOD = Method(
    name="dpfedavg",
    citation="McMahan et al., Learning Differentially Private Recurrent Language Models, "
             "ICLR 2018; Abadi et al., Deep Learning with Differential Privacy, CCS 2016",
    strategy=DPFLStrategy,
    trusts=ALL_TRUSTS,
)
