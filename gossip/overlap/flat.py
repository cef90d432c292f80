"""Persistent flat buffers: a model's parameters (or their gradients) as views into one flat
tensor on their device, so a synchronized step flattens and allocates nothing per round.

The layout is the parameters' order (``model.parameters()``), the order
``parameters_to_vector`` used, so results stay bitwise what they were. Views can be broken
from outside (``vector_to_parameters`` rebinds ``.data``, ``zero_grad(set_to_none=True)``
drops ``.grad``): ``bind`` notices and copies the values back into the buffer first.
"""

from __future__ import annotations

import weakref

import torch
from torch.nn.utils import parameters_to_vector


def _same_view(t: torch.Tensor | None, view: torch.Tensor) -> bool:
    return (t is not None and t.data_ptr() == view.data_ptr() and t.shape == view.shape
            and t.stride() == view.stride())


class FlatLayout:
    """Offsets of ``params`` in one flat vector, and the views of it shaped like each one.

    Args:
        params: Tensors of one dtype and device (a model's trainable parameters).

    Raises:
        ValueError: the parameters differ in dtype or device (no one flat tensor holds them).
    """

    def __init__(self, params: list[torch.Tensor]):
        if not params:
            raise ValueError("no parameters to lay out")
        first = params[0]
        if any(p.dtype != first.dtype or p.device != first.device for p in params):
            raise ValueError("parameters of several dtypes or devices")
        self.params = params
        self.dtype, self.device = first.dtype, first.device
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.numel = self.offsets[-1]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat``'s pieces, shaped like the parameters."""
        return [flat[a:b].view_as(p) for p, a, b in
                zip(self.params, self.offsets, self.offsets[1:])]


class FlatParams:
    """The parameters' ``.data`` are views into ``self.flat`` (their values unchanged)."""

    def __init__(self, layout: FlatLayout):
        self.layout = layout
        self.flat = torch.empty(layout.numel, dtype=layout.dtype, device=layout.device)
        self._views = layout.views(self.flat)
        self.bind()

    def bind(self) -> torch.Tensor:
        """Point every parameter whose ``.data`` left the buffer back into it (copying its
        values in); returns the flat tensor."""
        with torch.no_grad():
            for p, view in zip(self.layout.params, self._views):
                if not _same_view(p.data, view):
                    view.copy_(p.data)
                    p.data = view
        return self.flat

    def store(self, result: torch.Tensor) -> None:
        """Nothing to do: the result was written into the buffer."""


class FlatGrads:
    """The parameters' ``.grad`` are views into ``self.flat``: autograd accumulates into
    them in place, so the flat gradient needs no gathering."""

    def __init__(self, layout: FlatLayout):
        self.layout = layout
        self.flat = torch.zeros(layout.numel, dtype=layout.dtype, device=layout.device)
        self._views = layout.views(self.flat)
        self.bind()

    def bind(self, indices=None) -> torch.Tensor:
        """Bring every gradient (of the parameters at ``indices``, default all) into the
        buffer: a missing one reads as zeros, a tensor of its own is copied in; afterwards
        each ``.grad`` is its view. Returns the flat tensor."""
        params, views = self.layout.params, self._views
        with torch.no_grad():
            for i in range(len(params)) if indices is None else indices:
                p, view = params[i], views[i]
                if _same_view(p.grad, view):
                    continue
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad)
                p.grad = view
        return self.flat

    def store(self, result: torch.Tensor) -> None:
        """Nothing to do: the result was written into the buffer."""


class Gathered:
    """For parameters no one flat tensor can hold (several dtypes or devices): the same
    interface as FlatParams/FlatGrads, flattening (``bind``) and copying back (``store``)
    each time, as ``parameters_to_vector`` and ``vector_to_parameters`` would."""

    def __init__(self, params: list[torch.Tensor], grads: bool):
        self.params, self.grads = params, grads

    def bind(self) -> torch.Tensor:
        if not self.grads:
            return parameters_to_vector(self.params).detach()
        return parameters_to_vector([p.grad if p.grad is not None else torch.zeros_like(p)
                                     for p in self.params])

    def store(self, result: torch.Tensor) -> None:
        with torch.no_grad():
            offset = 0
            for p in self.params:
                piece = result[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
                if not self.grads:
                    p.copy_(piece)
                elif p.grad is None:
                    p.grad = piece.clone()
                else:
                    p.grad.copy_(piece)


class FlatCache:
    """One peer's flat buffers, per model (held weakly) and kind: built at a model's first
    step, kept while its trainable parameters stay the same tensors."""

    def __init__(self):
        self._by_model: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def get(self, model, params: list[torch.Tensor], kind: type[FlatParams] | type[FlatGrads]):
        """The ``kind`` buffer of ``model``'s ``params`` (``Gathered`` when no one flat
        tensor can hold them)."""
        entry = self._by_model.get(model)
        if entry is not None and entry[0] == kind and len(entry[1]) == len(params) and all(
                a is b for a, b in zip(entry[1], params)):
            return entry[2]
        try:
            flat = kind(FlatLayout(params))
        except ValueError:
            flat = Gathered(list(params), grads=kind is FlatGrads)
        self._by_model[model] = (kind, list(params), flat)
        return flat
