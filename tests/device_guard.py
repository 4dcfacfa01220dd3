"""A CPU stand-in for a second device: which tensors would sit on the model's device and which on the host.

On a GPU, the model's weights, the tokens the pass sends to it and everything computed from them are on CUDA; a tensor
built without a device (``torch.zeros(n)``), or brought back with ``.cpu()``, is on the host. An operation that mixes
the two (a host tensor with dimensions and a device tensor) raises "Expected all tensors to be on the same device",
and ``.numpy()`` of a device tensor raises too. On the CPU both are the same device and nothing fails: the
:class:`DeviceGuard` tags every tensor (``device``: a model weight, a ``.to(device)``, or anything computed from one;
``host``: a factory without a device, ``.cpu()``, ``from_numpy``) and records, at the innermost frame of ``analysis``,
each operation that would fail on the GPU.
"""

from __future__ import annotations

import traceback
import weakref
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parents[1] / "analysis"
_TO_HOST = {torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.tolist, torch.Tensor.item, torch.from_numpy}
# cross-device on CUDA: indexing a CUDA tensor with CPU indices, copying between devices, moving
_CROSS_OK = {
    torch.Tensor.__getitem__,
    torch.Tensor.__setitem__,
    torch.Tensor.copy_,
    torch.Tensor.to,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.__len__,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.__repr__,
    torch.Tensor.__format__,
    torch.Tensor.size,
    torch.Tensor.dim,
}


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


DEVICE = torch.device("cpu", 0)  # what ``.device`` of a device tensor says under the guard ("cpu:0": still the CPU)


def _names_a_device(args, kwargs) -> bool | None:
    """For ``.to``/factories: True when the model's device is named (``DEVICE``, which ``.device`` of a device tensor
    returns, or a ``.device`` of it passed on), False for the host ("cpu"), None when no device is named."""
    dev = kwargs.get("device")
    if dev is None:
        dev = next((a for a in args if isinstance(a, (str, torch.device))), None)
    if dev is None:
        return None
    return torch.device(dev) == DEVICE


class DeviceGuard(TorchFunctionMode):
    """Tag tensors device / host while analyses run on the CPU, and record what would fail on a GPU.

    Parameters
    ----------
    model : torch.nn.Module
        Its parameters and buffers are device tensors.
    """

    def __init__(self, model):
        super().__init__()
        self.tags: dict[int, str] = {}  # id(tensor) -> "dev" / "host", dropped when the tensor is freed
        self.found: Counter = Counter()
        for t in list(model.parameters()) + list(model.buffers()):
            self._tag(t, "dev")

    def _tag(self, t: torch.Tensor, tag: str) -> None:
        if id(t) not in self.tags:
            self.tags[id(t)] = tag
            weakref.finalize(t, self.tags.pop, id(t), None)

    def _is(self, t: torch.Tensor, tag: str) -> bool:
        return self.tags.get(id(t)) == tag

    def _where(self) -> str:
        for fr in reversed(traceback.extract_stack()[:-2]):
            if fr.filename.startswith(str(ROOT)) and not fr.filename.endswith("device_guard.py"):
                return f"{Path(fr.filename).relative_to(ROOT.parent)}:{fr.lineno}: {fr.line}"
        return "outside analysis"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is torch.Tensor.device:  # ``t.device``: cpu:0 for a device tensor
            return DEVICE if args and self._is(args[0], "dev") else func(*args, **kwargs)
        ins = list(_tensors(args)) + list(_tensors(kwargs))
        on_dev = any(self._is(t, "dev") for t in ins)
        host = [t for t in ins if self._is(t, "host") and t.dim() > 0]
        if func is torch.Tensor.numpy and on_dev:
            self.found[f"numpy() of a device tensor at {self._where()}"] += 1
        elif on_dev and host and func not in _CROSS_OK:
            self.found[
                f"{getattr(func, '__name__', func)} mixes a host tensor {tuple(host[0].shape)} with device "
                f"tensors at {self._where()}"
            ] += 1
        out = func(*args, **kwargs)
        if func in (torch.Tensor.cpu, torch.Tensor.to) and out is args[0]:
            out = out.clone()  # on a GPU ``.cpu()`` / ``.to(device)`` make a new tensor: give it its own tag
        if func in _TO_HOST:
            tag = "host"
            if isinstance(out, torch.Tensor):
                self.tags.pop(id(out), None)
        elif func is torch.Tensor.to:
            named = _names_a_device(args[1:], kwargs)
            tag = ("dev" if named else "host") if named is not None else ("dev" if on_dev else "host")
            self.tags.pop(id(out), None)
        elif not ins or (func in (torch.tensor, torch.as_tensor) and not on_dev):  # a factory
            tag = "dev" if _names_a_device((), kwargs) else "host"
        else:
            tag = "dev" if on_dev else ("host" if ins else None)
        if tag is not None:
            for t in _tensors(out):
                self._tag(t, tag)
        return out
