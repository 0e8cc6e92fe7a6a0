"""``fedavg``: the non-private reference (McMahan, Moore, Ramage, Hampson & Agüera y Arcas,
"Communication-Efficient Learning of Deep Networks from Decentralized Data", AISTATS 2017)
with plain-SGD clients: sample-count-weighted mean of the updates, server SGD step. No DP.
"""

from __future__ import annotations

from dpfl.method import Method
from dpfl.server.strategy import DPFLStrategy

METHOD = Method(
    name="fedavg",
    citation="McMahan et al., Communication-Efficient Learning of Deep Networks from "
             "Decentralized Data, AISTATS 2017",
    strategy=DPFLStrategy,
    trainers=("plain",),
    trainer_reason="'fedavg' is the non-private reference",
)
