"""Shared pieces of the quantizers (qsgd, terngrad, sign): arithmetic dtype and a scale."""

from __future__ import annotations

import math

import numpy as np
import torch

from gossip.compress.base import Header
from gossip.errors import ProtocolError


def work_dtype(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` in a dtype fit for arithmetic: 16-bit floats are widened to float32."""
    return flat if flat.dtype in (torch.float32, torch.float64) else flat.float()


def finite(value: float, what: str) -> float:
    """``value``, or ProtocolError if the input had inf/nan (the payload would be garbage)."""
    if not math.isfinite(value):
        raise ProtocolError(f"cannot compress a tensor with non-finite values ({what} = {value})")
    return value


def work_numpy(dtype: torch.dtype) -> type:
    """The numpy dtype decoded values are computed in before the cast to ``dtype``."""
    return np.float64 if dtype == torch.float64 else np.float32


def decoded(values: np.ndarray, head: Header) -> torch.Tensor:
    """Decoded values (numpy, work dtype) as a tensor of the payload's dtype and shape."""
    return torch.from_numpy(values).to(head.dtype).view(head.shape)
