"""Optimizers, gradient clipping and learning-rate schedules."""
from . import lr_scheduler
from .clip import clip_grad_norm_, clip_grad_value_
from .optimizer import SGD, Adagrad, Adam, AdamW, Optimizer, RMSprop

__all__ = ["SGD", "Adagrad", "Adam", "AdamW", "Optimizer", "RMSprop", "clip_grad_norm_", "clip_grad_value_",
           "lr_scheduler"]
