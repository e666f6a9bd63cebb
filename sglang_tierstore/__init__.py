"""sglang_tierstore: an L3 storage backend for SGLang's hierarchical cache.

SGLang loads ``TierStoreBackend`` from here (``--hicache-storage-backend dynamic``,
``"module_path": "sglang_tierstore", "class_name": "TierStoreBackend"``). The runtime is the
adapter (which imports SGLang) over the engine (:class:`TierStore`: Redis, xxhash and the
standard library); the operator tools (CLI, exporter, checks, planner) are
:mod:`sglang_tierstore.tools`, which the runtime never imports. Every name below is loaded
on first use (PEP 562), so importing a submodule, a tool among them, loads only what that
submodule imports (and no module imports its way back here).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "ConfigError": "errors",
    "EmbeddedRedisError": "errors",
    "IndexUnavailable": "errors",
    "PageIOError": "errors",
    "TierStoreError": "errors",
    "TierStore": "store",
    "TierStoreBackend": "adapter",
    "TierStoreConfig": "config",
}
__all__ = ["ConfigError", "EmbeddedRedisError", "IndexUnavailable", "PageIOError", "TierStore", "TierStoreBackend",
           "TierStoreConfig", "TierStoreError"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'sglang_tierstore' has no attribute {name!r}")
    value = getattr(import_module(f"sglang_tierstore.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
