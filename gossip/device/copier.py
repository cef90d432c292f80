"""Copies between a device and host memory that signal completion through an event.

``CudaCopier`` issues non-blocking copies on a side stream that first waits for the
compute stream (so it copies what the model last wrote), and records an event per copy:
reading a non-blocking device-to-host result before its event completes gives wrong
values. ``HostCopier`` is the same interface for CPU tensors (copies done at once), which is
how the pipelining logic is tested without a GPU.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Done:
    """The event of a copy that has already happened."""

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        return True


class Copier(ABC):
    """Starts copies and returns an event with ``synchronize()`` (and ``query()``)."""

    @abstractmethod
    def start(self, dst: torch.Tensor, src: torch.Tensor):
        """Begin ``dst.copy_(src)``; returns its completion event."""

    def after_device_work(self) -> None:
        """Order the next copies after the work queued so far on the caller's stream."""

    def before_device_use(self, event) -> None:
        """Make the caller's stream wait for ``event`` (a host-to-device copy) before it uses
        the copy's destination."""
        event.synchronize()


class HostCopier(Copier):
    """Synchronous copies (CPU tensors, or a device without streams)."""

    def start(self, dst, src):
        dst.copy_(src)
        return Done()


class CudaCopier(Copier):
    """Non-blocking copies on one side stream of ``device``, one event per copy."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def after_device_work(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def start(self, dst, src):
        event = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event.record(self.stream)
        return event

    def before_device_use(self, event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)


def copier_for(device: torch.device) -> Copier:
    """A CudaCopier for a CUDA device, a HostCopier for anything else."""
    if device.type == "cuda":
        return CudaCopier(device)
    return HostCopier()
