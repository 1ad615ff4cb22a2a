"""Module and containers, with torch's names for parameters and state-dict keys, so that a
gtmpi checkpoint loads into the same model written in plain torch and the other way round."""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Callable, ItemsView, Iterator, KeysView, NamedTuple, ValuesView

import numpy as np
import torch

from ..autograd import no_grad, zero_grads
from ..client.creation import beside, tensor
from ..client.replay import STATE
from ..client.tensor import Tensor, split_device
from . import capture
from .parameter import Parameter

_hook_ids = itertools.count()


class _IncompatibleKeys(NamedTuple):
    """What load_state_dict returns, as torch's: the keys it did not find and did not use."""
    missing_keys: list[str]
    unexpected_keys: list[str]


class RemovableHandle:
    """What register_*_hook returns: ``handle.remove()`` takes the hook away."""

    def __init__(self, hooks: dict, key: int) -> None:
        self._hooks, self._key = hooks, key

    def remove(self) -> None:
        self._hooks.pop(self._key, None)
        STATE.bump()


class Module:
    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_non_persistent", set())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_forward_hooks", OrderedDict())
        object.__setattr__(self, "_forward_pre_hooks", OrderedDict())
        object.__setattr__(self, "training", True)

    def __setattr__(self, name: str, value: Any) -> None:
        STATE.bump()  # a capture's guard walks the modules again (client/replay.py)
        buffers = self.__dict__.get("_buffers")
        if buffers is not None and name in buffers and (value is None or
                                                        type(value) is Tensor):
            buffers[name] = value  # a registered buffer stays one when assigned anew
            return
        for table in (self._parameters, self._buffers, self._modules):
            table.pop(name, None)
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        else:
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        for table in ("_parameters", "_buffers", "_modules"):
            entries = self.__dict__.get(table)
            if entries is not None and name in entries:
                return entries[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __delattr__(self, name: str) -> None:
        STATE.bump()
        for table in (self._parameters, self._buffers, self._modules):
            if name in table:
                del table[name]
                return
        object.__delattr__(self, name)

    def register_buffer(self, name: str, value: Tensor | None, persistent: bool = True) -> None:
        """A tensor the module keeps and moves with it; in the state dict unless not
        ``persistent`` (torch's rule)."""
        STATE.bump()
        self.__dict__.pop(name, None)
        self._buffers[name] = value
        if isinstance(value, Tensor):
            value._state = True
        if persistent:
            self._non_persistent.discard(name)
        else:
            self._non_persistent.add(name)

    def register_parameter(self, name: str, value: Parameter | None) -> None:
        STATE.bump()
        self._parameters[name] = value

    def add_module(self, name: str, module: "Module | None") -> None:
        STATE.bump()
        self._modules[name] = module

    register_module = add_module

    def get_submodule(self, target: str) -> "Module":
        module = self
        for part in filter(None, target.split(".")):
            module = module._modules[part]
        return module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no forward()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return capture.call(self, args, kwargs, self._call)

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        for hook in list(self._forward_pre_hooks.values()):
            changed = hook(self, args)
            if changed is not None:
                args = changed if isinstance(changed, tuple) else (changed,)
        out = self.forward(*args, **kwargs)
        for hook in list(self._forward_hooks.values()):
            changed = hook(self, args, out)
            if changed is not None:
                out = changed
        return out

    def register_forward_hook(self, hook: Callable) -> RemovableHandle:
        """hook(module, args, output) after forward; a result other than None replaces the
        output."""
        return self._hook(self._forward_hooks, hook)

    def register_forward_pre_hook(self, hook: Callable) -> RemovableHandle:
        """hook(module, args) before forward; a result other than None replaces the args."""
        return self._hook(self._forward_pre_hooks, hook)

    @staticmethod
    def _hook(hooks: dict, hook: Callable) -> RemovableHandle:
        key = next(_hook_ids)
        hooks[key] = hook
        STATE.bump()
        return RemovableHandle(hooks, key)

    # traversal: torch's orders, each module and each tensor once -----------------------------

    def named_modules(self, memo: set | None = None, prefix: str = "",
                      remove_duplicate: bool = True) -> Iterator[tuple[str, "Module"]]:
        if memo is None:
            memo = set()
        if remove_duplicate:
            if id(self) in memo:
                return
            memo.add(id(self))
        yield prefix, self
        for name, child in self._modules.items():
            if child is not None:
                yield from child.named_modules(memo, f"{prefix}.{name}" if prefix else name,
                                               remove_duplicate)

    def modules(self) -> Iterator["Module"]:
        return (m for _, m in self.named_modules())

    def named_children(self) -> Iterator[tuple[str, "Module"]]:
        return ((n, m) for n, m in self._modules.items() if m is not None)

    def children(self) -> Iterator["Module"]:
        return (m for _, m in self.named_children())

    def _named(self, table: str, prefix: str, recurse: bool,
               remove_duplicate: bool = True) -> Iterator[tuple[str, Tensor]]:
        """A shared tensor (tied weights) comes once, under its first name, as in torch."""
        seen: set[int] = set()
        modules = self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate) \
            if recurse else [(prefix, self)]
        for path, module in modules:
            for name, value in getattr(module, table).items():
                if value is None or (remove_duplicate and id(value) in seen):
                    continue
                seen.add(id(value))
                yield (f"{path}.{name}" if path else name), value

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, Parameter]]:
        return self._named("_parameters", prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        if not recurse:
            return (p for _, p in self.named_parameters(recurse=False))
        # a training loop asks every step (clip_grad_norm_(model.parameters())): the tree's
        # walk is kept until a module changes (STATE)
        kept = self.__dict__.get("_parameters_at")
        if kept is None or kept[0] != STATE.value:
            kept = (STATE.value, [p for _, p in self.named_parameters()])
            object.__setattr__(self, "_parameters_at", kept)
        return iter(kept[1])

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, Tensor]]:
        return self._named("_buffers", prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[Tensor]:
        return (b for _, b in self.named_buffers(recurse=recurse))

    def apply(self, fn: Callable[["Module"], Any]) -> "Module":
        """fn on every submodule, children first, then on this one (torch's order)."""
        for child in self.children():
            child.apply(fn)
        fn(self)
        return self

    # modes and state ------------------------------------------------------------------------

    def train(self, mode: bool = True) -> "Module":
        STATE.bump()
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> "Module":
        return self.train(False)

    def requires_grad_(self, requires_grad: bool = True) -> "Module":
        for p in self.parameters():
            p.requires_grad_(requires_grad)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        zero_grads(self.parameters(), set_to_none)

    def state_dict(self, destination: Any = None, prefix: str = "",
                   keep_vars: bool = False) -> "OrderedDict[str, Tensor]":
        """torch's keys in torch's order: each module's parameters then its persistent
        buffers, module by module; a tied weight under each of its names. The values are the
        parameters and buffers themselves (torch's keep_vars=True): a detached alias would
        cost an instruction per tensor, and reads and copies treat both alike."""
        state = OrderedDict() if destination is None else destination
        for path, module in self.named_modules(prefix=prefix.rstrip("."), remove_duplicate=False):
            head = f"{path}." if path else ""
            for name, p in module._parameters.items():
                if p is not None:
                    state[head + name] = p
            for name, b in module._buffers.items():
                if b is not None and name not in module._non_persistent:
                    state[head + name] = b
        return state

    def load_state_dict(self, state: Mapping, strict: bool = True,
                        assign: bool = False) -> _IncompatibleKeys:
        """Values from torch or gtmpi tensors or numpy arrays, copied in place where each
        parameter or buffer lives; returns (missing_keys, unexpected_keys) as torch does."""
        if not isinstance(state, Mapping):
            raise TypeError(f"Expected state_dict to be dict-like, got {type(state)}.")
        own = self.state_dict(keep_vars=True)
        missing = [k for k in own if k not in state]
        unexpected = [k for k in state if k not in own]
        if strict and (missing or unexpected):
            parts = []
            if unexpected:
                parts.append("Unexpected key(s) in state_dict: " +
                             ", ".join(f'"{k}"' for k in unexpected) + ". ")
            if missing:
                parts.append("Missing key(s) in state_dict: " +
                             ", ".join(f'"{k}"' for k in missing) + ". ")
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}:\n\t" +
                               "\n\t".join(parts))
        with no_grad():
            for name, target in own.items():
                if name not in state:
                    continue
                value = state[name]
                if isinstance(value, Tensor) and value._host is not None:
                    # a loaded checkpoint's value the client still holds: placed as below, where
                    # the parameter lives, not as one of the program's uploads (which a config
                    # may split)
                    value = value._host
                if isinstance(value, (torch.Tensor, np.ndarray)) and target._host is not None:
                    value = tensor(value)  # copied here: the client holds the parameter yet
                elif isinstance(value, (torch.Tensor, np.ndarray)):
                    with beside(target):  # uploaded where the parameter lives: nothing moves
                        value = tensor(value)
                if tuple(value.shape) != tuple(target.shape):
                    raise RuntimeError(f"size mismatch for {name}: copying a param with shape "
                                       f"{tuple(value.shape)} from checkpoint, the shape in "
                                       f"current model is {tuple(target.shape)}.")
                target.copy_(value)
        return _IncompatibleKeys(missing, unexpected)

    def to(self, *args: Any, **kwargs: Any) -> "Module":
        """Convert floating-point parameters and buffers to a dtype among the arguments. A GPU
        device hands the parameters and buffers the client still holds to the workers now
        (which workers is the runtime's choice, by signals and configs)."""
        dtype, device = split_device(args, kwargs)
        if device is not None and device.type != "cpu":
            for t in [*self.parameters(), *self.buffers()]:
                t.id  # placed: its upload starts
        if dtype is None:
            return self
        with no_grad():
            for module in self.modules():
                for p in module._parameters.values():
                    if p is not None and p.dtype.is_floating_point and p.dtype != dtype:
                        # as torch does it, the same Parameter, its gradient converted too: an
                        # optimizer made before still holds what the model holds
                        _convert_in_place(p, dtype)
                        if p.grad is not None and p.grad.dtype != dtype:
                            _convert_in_place(p.grad, dtype)
                for name, b in list(module._buffers.items()):
                    if b is not None and b.dtype.is_floating_point:
                        module._buffers[name] = b.to(dtype)
                        STATE.bump()
        return self

    def cpu(self) -> "Module":
        return self

    def cuda(self, device: Any = None) -> "Module":
        return self.to("cuda")

    def float(self) -> "Module":
        return self.to(torch.float32)

    def half(self) -> "Module":
        return self.to(torch.float16)

    def double(self) -> "Module":
        return self.to(torch.float64)

    def bfloat16(self) -> "Module":
        return self.to(torch.bfloat16)

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = [f"  ({name}): " + repr(m).replace("\n", "\n  ") for name, m in self.named_children()]
        head = f"{type(self).__name__}({self.extra_repr()}"
        return head + ("\n" + "\n".join(lines) + "\n)" if lines else ")")


def _convert_in_place(t: Tensor, dtype: torch.dtype) -> None:
    """``t`` itself takes ``dtype``: its converted copy's id and signature are swapped in, and
    the copy, now holding the old id, is dropped (which frees the old values)."""
    if t._host is not None:
        t._host, t._recipe, t._sig = t._host.to(dtype), None, (t.shape, dtype)
        return
    new = t.to(dtype)
    t.id, new.id = new.id, t.id
    t._sig, new._sig = new._sig, t._sig
    t._strides = None


class ModuleList(Module):
    def __init__(self, modules: Any = ()) -> None:
        super().__init__()
        for m in modules:
            self.append(m)

    def append(self, module: Module) -> "ModuleList":
        self.add_module(str(len(self._modules)), module)
        return self

    def __getitem__(self, i: int) -> Module:
        return list(self._modules.values())[i]

    def __setitem__(self, i: int, module: Module) -> None:
        """torch's ``layers[i] = module`` (a negative index counts from the end)."""
        self.add_module(list(self._modules)[i], module)

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())


class Sequential(ModuleList):
    """Modules applied in order; state-dict keys "0.weight", "1.bias", ... as in torch."""

    def __init__(self, *modules: Module) -> None:
        super().__init__(modules)

    def forward(self, x: Any) -> Any:
        for m in self._modules.values():
            x = m(x)
        return x


class ParameterList(Module):
    """Parameters by position, registered as "0", "1", ... as torch's (a tensor given is made
    a Parameter)."""

    def __init__(self, values: Any = None) -> None:
        super().__init__()
        for value in values or ():
            self.append(value)

    def append(self, value: Any) -> "ParameterList":
        self.register_parameter(str(len(self._parameters)), _as_parameter(value))
        return self

    def extend(self, values: Any) -> "ParameterList":
        for value in values:
            self.append(value)
        return self

    def __getitem__(self, i: int) -> Any:
        return list(self._parameters.values())[i]

    def __setitem__(self, i: int, value: Any) -> None:
        self.register_parameter(list(self._parameters)[i], _as_parameter(value))

    def __len__(self) -> int:
        return len(self._parameters)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._parameters.values())


class _Named(Module):
    """A container module read as a dict: the one of its own dicts that ``_held`` names."""
    _held = ""

    def __getitem__(self, key: str) -> Any:
        return getattr(self, self._held)[key]

    def __contains__(self, key: str) -> bool:
        return key in getattr(self, self._held)

    def __len__(self) -> int:
        return len(getattr(self, self._held))

    def __iter__(self) -> Iterator[str]:
        return iter(getattr(self, self._held))

    def keys(self) -> KeysView[str]:
        return getattr(self, self._held).keys()

    def items(self) -> ItemsView[str, Any]:
        return getattr(self, self._held).items()

    def values(self) -> ValuesView[Any]:
        return getattr(self, self._held).values()


class ParameterDict(_Named):
    """Parameters by name, as torch's (a tensor given is made a Parameter)."""
    _held = "_parameters"

    def __init__(self, parameters: Any = None) -> None:
        super().__init__()
        for key, value in dict(parameters or {}).items():
            self[key] = value

    def __setitem__(self, key: str, value: Any) -> None:
        self.register_parameter(key, _as_parameter(value))


def _as_parameter(value: Any) -> Any:
    from .parameter import Parameter
    return value if value is None or isinstance(value, Parameter) else Parameter(value)


class ModuleDict(_Named):
    _held = "_modules"

    def __init__(self, modules: dict | None = None) -> None:
        super().__init__()
        for k, m in (modules or {}).items():
            self.add_module(k, m)

    def __setitem__(self, key: str, module: Module) -> None:
        self.add_module(key, module)
