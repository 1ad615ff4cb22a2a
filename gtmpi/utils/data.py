"""torch.utils.data on gtmpi: TensorDataset and DataLoader (torch's own samplers, Subset,
ConcatDataset and random_split, which only index a dataset, work on gtmpi's as they are).

Which samples make each batch is torch's own choice: torch's samplers (sequential, random
with a generator, drop_last) pick the indices, so a seeded loader gives torch's batches. A
batch of a TensorDataset is then one gather per tensor on the workers (``t[indices]``), not a
stack of single samples; other datasets' samples are stacked (tensors) or collated as torch
collates them (numbers, host tensors, and dicts, lists and tuples of them).
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
# torch's, under its names: they choose indices or index a dataset, nothing more
from torch.utils.data import (BatchSampler, ConcatDataset, Dataset, IterableDataset,  # noqa: F401
                              RandomSampler, Sampler, SequentialSampler, Subset,
                              SubsetRandomSampler, WeightedRandomSampler, random_split)

from ..autograd import no_grad
from ..client.creation import tensor as _tensor
from ..client.functions import stack
from ..client.tensor import Tensor
from ..signals import as_state


class TensorDataset:
    """Samples are the tensors' rows: dataset[i] = tuple(t[i] for t in tensors)."""

    def __init__(self, *tensors: Any) -> None:
        if not tensors:
            raise ValueError("TensorDataset needs at least one tensor")
        if any(t.shape[0] != tensors[0].shape[0] for t in tensors):
            raise ValueError("Size mismatch between tensors: every tensor's first dimension "
                             f"must match ({[t.shape[0] for t in tensors]})")
        self.tensors = tuple(_whole(_tensor(t) if not isinstance(t, Tensor) else t)
                             for t in tensors)

    def __getitem__(self, index: Any) -> tuple:
        return tuple(_rows(t, index) for t in self.tensors)

    def __len__(self) -> int:
        return self.tensors[0].shape[0]


class DataLoader:
    """torch's DataLoader(dataset, batch_size=1, shuffle=False, sampler=None,
    batch_sampler=None, drop_last=False, generator=None, collate_fn=None); worker processes
    (num_workers, pin_memory) are accepted and not used: batches are made by rank 0's issuing."""

    def __init__(self, dataset: Any, batch_size: int | None = 1, shuffle: bool | None = None,
                 sampler: Any = None, batch_sampler: Any = None, num_workers: int = 0,
                 collate_fn: Any = None, pin_memory: bool = False, drop_last: bool = False,
                 generator: Any = None, **_: Any) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.batch_size = batch_size
        # torch's own loader over the indices: its samplers, shuffling and drop_last
        self._indices = torch.utils.data.DataLoader(
            range(len(dataset)), batch_size=batch_size, shuffle=shuffle, sampler=sampler,
            batch_sampler=batch_sampler, drop_last=drop_last, generator=generator)

    def __len__(self) -> int:
        return len(self._indices)

    def __iter__(self) -> Iterator[Any]:
        for index in self._indices:
            yield self._batch(index)

    def _batch(self, index: Any) -> Any:
        if self.batch_size is None and not isinstance(index, torch.Tensor):
            return self.dataset[int(index)]
        dataset = self.dataset
        while isinstance(dataset, Subset) and self.collate_fn is None:  # a split's rows
            index = torch.as_tensor(dataset.indices)[index]
            dataset = dataset.dataset
        if isinstance(dataset, TensorDataset) and self.collate_fn is None:
            return [_rows(t, index) for t in dataset.tensors]
        samples = [self.dataset[int(i)] for i in index]
        return (self.collate_fn or default_collate)(samples)


def _whole(t: Tensor) -> Tensor:
    """A dataset's tensor already on the workers (host tensors off), as a data-parallel config
    places the model: whole on every worker, so that each takes its rows of a batch (whose
    indices are split as any upload) without gathering the dataset for every batch."""
    if t._host is not None:
        return t
    with no_grad():
        whole = as_state(t)
    return t if whole is None else whole


def _rows(t: Tensor, index: Any) -> Tensor:
    """``t[index]``: taken by the client from the value it holds, as torch's loader takes a
    batch from host memory, so that the batch is an upload (split by a data-parallel config)
    and the dataset never goes to the workers (placed split, every batch would gather it
    whole); a dataset already on the workers is indexed there."""
    value = t._host
    if value is None or value.is_meta:
        return t[_tensor(index) if isinstance(index, torch.Tensor) else index]
    return _tensor(value[index])


def default_collate(samples: list) -> Any:
    """torch's default_collate for gtmpi tensors too: tensors stacked along a new first
    dimension, numbers made tensors, dicts, lists and tuples collated field by field."""
    first = samples[0]
    if isinstance(first, Tensor):
        return stack(samples)
    if isinstance(first, dict):
        return {k: default_collate([s[k] for s in samples]) for k in first}
    if isinstance(first, (list, tuple)):
        return [default_collate(list(field)) for field in zip(*samples)]
    return _tensor(torch.utils.data.default_collate(samples))
