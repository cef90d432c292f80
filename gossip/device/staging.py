"""The Peer's host staging of device tensors: strategies and the transport work on host
memory, so a CUDA tensor goes device -> host -> strategy -> device each round.

Instead of ``x.cpu()`` (pageable memory, a new allocation every round, a copy that blocks
the caller's stream) the tensor is copied into a host buffer allocated once per peer and
dtype (page-locked when CUDA is there), on a side stream that waits for the compute stream;
the strategy runs in place on that buffer; the result goes back with a non-blocking copy
that the compute stream waits for, so the host never waits on the device's return trip.

A strategy that keeps its tensor between calls (``keeps_tensor``: adpsgd answers and applies
exchanges in ``poll`` and ``finish``) moves the host buffer while the caller computes. That
buffer is then the model: the next call adds only what the caller changed since the last
return (its optimizer step) instead of copying the device tensor over the moves, and
``write_back`` gives the caller the moves made after its last call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gossip.device.copier import Copier, copier_for
from gossip.device.pool import can_pin


class HostStaging:
    """Runs ``run(x_host, out_host)`` for a tensor on any device (see the module docstring).

    Args:
        pin: Page-lock the host buffers (default: when CUDA is available).
        copier_for: Builds the Copier of a device (tests pass a fake one).
    """

    def __init__(self, *, pin: bool | None = None,
                 copier_for: Callable[[torch.device], Copier] = copier_for):
        self.pin = can_pin() if pin is None else pin
        self._copier_for = copier_for
        self._copiers: dict[torch.device, Copier] = {}
        self._buffers: dict[torch.dtype, torch.Tensor] = {}
        self.allocations = 0  # host buffers allocated so far (tests check the reuse)
        # A kept tensor's last return: (host buffer, its copy as returned, where it went,
        # scratch for the next call's copy of the caller's tensor).
        self._kept: tuple[torch.Tensor, ...] | None = None

    def run(self, x: torch.Tensor, run: Callable[[torch.Tensor, torch.Tensor | None],
                                                  torch.Tensor],
            out: torch.Tensor | None = None, *, kept: bool = False) -> torch.Tensor:
        """``run`` on a contiguous host ``x``; a device tensor's result comes back on its
        device (into ``out`` if given). ``kept``: the strategy keeps the tensor between
        calls (see the module docstring)."""
        if x.device.type == "cpu":
            return run(x.contiguous(), out)
        return self.stage(x, run, out, kept=kept)

    def stage(self, x: torch.Tensor, run: Callable[[torch.Tensor, torch.Tensor | None],
                                                    torch.Tensor],
              out: torch.Tensor | None = None, *, kept: bool = False) -> torch.Tensor:
        """The staged path of ``run`` for any tensor (CPU ones too: tests use it so)."""
        copier = self._copier(x.device)
        host = self._buffer(x.dtype, x.numel()).view(x.shape)
        copier.after_device_work()
        last = self._kept
        same = (last is not None and last[0].data_ptr() == host.data_ptr()
                and last[1].shape == host.shape)
        if kept and same:
            # host = host - returned + x: the strategy's moves since, plus the caller's step
            # (exactly x when nothing moved). ``fresh`` becomes the next ``returned``.
            fresh = last[3]
            copier.start(fresh, x).synchronize()
            host.sub_(last[1]).add_(fresh)
        else:
            copier.start(host, x).synchronize()
        result = run(host, host)  # in place: the buffer is ours alone until the next round
        dest = torch.empty_like(x) if out is None else out
        done = copier.start(dest, result.view_as(dest))
        if kept:  # polls write the buffer at any time: the copy must have read it first
            done.synchronize()
            self._keep(host, dest, last if same else None)
        # Otherwise the next round's copy into ``host`` is queued behind this one on the
        # same stream, and the host waits for that copy before writing: the buffer is never
        # overwritten while this copy still reads it.
        copier.before_device_use(done)
        return dest

    def write_back(self) -> None:
        """Copy a kept tensor's host buffer to where its last call returned it (the moves
        the strategy made since, e.g. in ``finish``); nothing without one."""
        if self._kept is None:
            return
        host, _, dest, _ = self._kept
        copier = self._copier(dest.device)
        copier.after_device_work()
        done = copier.start(dest, host.view_as(dest))
        done.synchronize()
        copier.before_device_use(done)
        self._keep(host, dest, self._kept)

    def _keep(self, host: torch.Tensor, dest: torch.Tensor, last: tuple | None) -> None:
        """Remember a kept tensor's return: its host buffer, a copy of it as returned, where
        it went, and a scratch buffer; the two copies are reused while the size stays."""
        returned, scratch = ((last[3], last[1]) if last is not None
                             else (torch.empty_like(host), torch.empty_like(host)))
        returned.copy_(host)
        self._kept = (host, returned, dest, scratch)

    def _copier(self, device: torch.device) -> Copier:
        if device not in self._copiers:
            self._copiers[device] = self._copier_for(device)
        return self._copiers[device]

    def _buffer(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A flat host buffer of at least ``numel``, grown (rarely) but never per round."""
        buffer = self._buffers.get(dtype)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, pin_memory=self.pin)
            self._buffers[dtype] = buffer
            self.allocations += 1
        return buffer[:numel]
