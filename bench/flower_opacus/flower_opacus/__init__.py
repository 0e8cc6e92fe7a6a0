"""Flower's Opacus example on dpfl's demo task (bench/opacus_compare.py)."""
