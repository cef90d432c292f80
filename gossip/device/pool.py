"""Host slots allocated once per peer and reused round after round.

Pinning memory (cudaHostAlloc) is slow and pinning per call can make a copy twice as slow
as a plain one, so the pool pins its slots once, when CUDA is there. A slot handed to a
zero-copy send is busy until that send completes: ``release_after`` records how to wait for
it, and the slot's next ``acquire`` waits first (the transport is single-threaded, so the
pool needs no lock: a busy slot simply blocks its next user, never another thread).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gossip.errors import ConfigError


def can_pin() -> bool:
    """Whether page-locked host memory is available (it needs a CUDA driver)."""
    return torch.cuda.is_available()


class HostPool:
    """``depth`` host buffers of ``slot_bytes`` each, handed out round-robin.

    Args:
        slot_bytes: Size of every slot (a piece of a pipelined copy).
        depth: Slots in the pool: 2 lets the copy of piece i+1 overlap the send of piece i.
        pin: Page-lock the slots (default: when CUDA is available).
    """

    def __init__(self, slot_bytes: int, depth: int = 3, *, pin: bool | None = None):
        if not isinstance(slot_bytes, int) or slot_bytes <= 0:
            raise ConfigError(f"host pool slot_bytes must be an int > 0, got {slot_bytes!r}")
        if not isinstance(depth, int) or depth < 2:
            raise ConfigError(f"host pool depth must be an int >= 2 (a copy overlaps a "
                              f"send), got {depth!r}")
        self.pinned = can_pin() if pin is None else pin
        self.slot_bytes = slot_bytes
        self._slots = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=self.pinned)
                       for _ in range(depth)]
        self._busy: list[Callable[[], None] | None] = [None] * depth
        self._next = 0
        self.allocations = depth  # never grows: tests check the pool is reused

    @property
    def depth(self) -> int:
        return len(self._slots)

    def acquire(self, dtype: torch.dtype, numel: int) -> tuple[int, torch.Tensor]:
        """The next slot (waiting for its previous send first) as ``numel`` of ``dtype``."""
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        if nbytes > self.slot_bytes:
            raise ValueError(f"a piece of {nbytes} bytes does not fit a {self.slot_bytes}-byte "
                             f"slot")
        index = self._next
        self._next = (index + 1) % len(self._slots)
        self.wait(index)
        return index, self._slots[index][:nbytes].view(dtype)

    def release_after(self, index: int, wait: Callable[[], None]) -> None:
        """Slot ``index`` is free once ``wait()`` returns (e.g. a zero-copy send's delivery)."""
        self._busy[index] = wait

    def wait(self, index: int) -> None:
        """Block until slot ``index`` is free."""
        wait, self._busy[index] = self._busy[index], None
        if wait is not None:
            wait()

    def drain(self) -> None:
        """Wait for every slot (before the pool's memory is dropped or reused whole)."""
        for index in range(len(self._slots)):
            self.wait(index)
