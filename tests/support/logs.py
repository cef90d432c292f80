"""What a transport logs: the rejection reasons, in order."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager


class Reasons(logging.Handler):
    """Every rejection reason rank 0 logs, in order, quiet repeats included."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "rejected message" in record.msg and record.args[0] == 0:
            self.reasons.append(record.args[1])

    def seen(self, pattern: str) -> bool:
        return any(re.search(pattern, reason) for reason in list(self.reasons))


@contextmanager
def rejection_reasons() -> Iterator[Reasons]:
    """The rejection reasons rank 0's transport logs while the block runs."""
    handler, logger = Reasons(), logging.getLogger("gossip.transport")
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
