"""Reading a socket a bounded number of frames at a time, so one sender's flood cannot hold
up the others (docs/ARCHITECTURE.md, Frame floods).

Once a message's first frame is read, libzmq yields only that message's frames until its
last, and reading one from Python costs about 1 µs: a message of a million frames would hold
its reader a second. Each sender has a socket of its own (zmq.py), and a ``Drain`` reads at
most ``budget`` frames of it per poll turn, carrying a message over to the next turn when it
is longer: the other senders' messages are read between turns. A message of more frames than
any valid one is counted frame by frame, each let go as the next comes (constant memory),
and handed on as ``Oversized`` at its end.
"""

from __future__ import annotations

from dataclasses import dataclass

import zmq

# Frames read from one socket per turn: a flood delays the other senders by about this many
# frame reads (~1 ms) per turn, however long it is.
FRAMES_PER_TURN = 1_000
_NOBLOCK, _EVENTS, _POLLIN = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.POLLIN)


@dataclass(frozen=True)
class Oversized:
    """A message of more frames than ``Drain.max_frames``, read and let go."""

    frames: int
    nbytes: int


class Drain:
    """The messages of one socket, read at most ``budget`` frames per ``read``.

    Args:
        socket: The socket to read (never blocks: the parts of a message arrive together).
        max_frames: Messages with more frames are read to their end and returned as
            ``Oversized``, holding none of them.
    """

    def __init__(self, socket: zmq.Socket, max_frames: int):
        self.socket, self.max_frames = socket, max_frames
        self._frames: list = []  # the message under way (emptied once it is oversized)
        self._count = self._nbytes = 0

    def read(self, budget: int = FRAMES_PER_TURN) -> list:
        """The messages completed within ``budget`` frames: each a list of frames, or
        ``Oversized``. Empty when nothing is waiting (or the budget went to a long one)."""
        socket = self.socket
        recv, done = socket.recv, []
        for _ in range(budget):
            try:
                frame = recv(_NOBLOCK, copy=False)
            except zmq.Again:
                break
            self._count += 1
            self._nbytes += len(frame)
            if self._count <= self.max_frames:
                self._frames.append(frame)
            elif self._frames:
                self._frames = []  # over the bound: counted from now on, never held
            if not frame.more:
                done.append(self._frames if self._count <= self.max_frames
                            else Oversized(self._count, self._nbytes))
                self._frames, self._count, self._nbytes = [], 0, 0
                # Asking whether another message waits is cheaper than the exception a
                # read of an empty socket raises.
                if not socket.getsockopt(_EVENTS) & _POLLIN:
                    break
        return done
