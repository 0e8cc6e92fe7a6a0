"""dpfl: differentially private federated learning on Flower, PyTorch and Opacus."""

__version__ = "0.1.0"
