"""sglang_tierstore: an L3 storage backend for SGLang's hierarchical cache.

SGLang loads ``TierStoreBackend`` from here (``--hicache-storage-backend dynamic``,
``"module_path": "sglang_tierstore", "class_name": "TierStoreBackend"``). The
adapter imports SGLang, so it is loaded on first use; the engine underneath
(:class:`TierStore`) needs only Redis, xxhash and the standard library.
"""

from __future__ import annotations

from typing import Any

from sglang_tierstore.config import TierStoreConfig
from sglang_tierstore.errors import (
    ConfigError,
    EmbeddedRedisError,
    IndexUnavailable,
    PageIOError,
    TierStoreError,
)
from sglang_tierstore.store import TierStore

__all__ = [
    "ConfigError",
    "EmbeddedRedisError",
    "IndexUnavailable",
    "PageIOError",
    "TierStore",
    "TierStoreBackend",
    "TierStoreConfig",
    "TierStoreError",
]


def __getattr__(name: str) -> Any:
    if name == "TierStoreBackend":
        from sglang_tierstore.adapter import TierStoreBackend

        return TierStoreBackend
    raise AttributeError(name)
