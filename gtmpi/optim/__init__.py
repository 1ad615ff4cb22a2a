"""Optimizers, gradient clipping and learning-rate schedules."""
from . import lr_scheduler
from .clip import clip_grad_norm_, clip_grad_value_
from .optimizer import SGD, Adam, AdamW, Optimizer

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "clip_grad_norm_", "clip_grad_value_",
           "lr_scheduler"]
