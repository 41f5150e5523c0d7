"""Optimizers built on :mod:`flexdemo.compression`: per-step DeMo and the DiLoCo outer step."""

from flexdemo.optim.demo import DeMo

__all__ = ["DeMo"]
