"""What each compressor and wrapper takes: options, defaults and one-line docs, read from
their ``option()`` declarations (``gossip compressors``)."""

from __future__ import annotations

from typing import Any

from gossip.compress.base import COMPRESSORS
from gossip.compress.compose import WrapperOptions
from gossip.registry import summary


def describe() -> list[dict[str, Any]]:
    """Per registered compressor: name, doc and its options; then the wrappers' options
    (``name`` "wrappers"), which every compressor takes."""
    rows = [{"name": name, "doc": summary(COMPRESSORS.get(name)),
             "options": COMPRESSORS.get(name).options_class.describe()}
            for name in COMPRESSORS.names()]
    rows.append({"name": "wrappers", "doc": summary(WrapperOptions),
                 "options": WrapperOptions.describe()})
    return rows
