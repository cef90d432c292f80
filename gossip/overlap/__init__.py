"""Overlapping communication with computation (``Peer.attach``) and the persistent flat
buffers ``Peer.step`` keeps parameters and gradients in (docs/ARCHITECTURE.md, Overlap)."""

from gossip.overlap.attach import Overlap, refusal
from gossip.overlap.buckets import DEFAULT_BUCKET_MB, DEFAULT_FIRST_BUCKET_MB, Bucket, plan_buckets
from gossip.overlap.flat import FlatGrads, FlatLayout, FlatParams

__all__ = ["DEFAULT_BUCKET_MB", "DEFAULT_FIRST_BUCKET_MB", "Bucket", "FlatGrads", "FlatLayout",
           "FlatParams", "Overlap", "plan_buckets", "refusal"]
