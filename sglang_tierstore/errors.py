"""One exception root for the package.

Each subclass also inherits the builtin it stands for, so callers that only know
``OSError`` or ``ValueError`` still catch it. Only the SGLang adapter turns these
into misses and ``False``; everything below it raises.
"""

from __future__ import annotations


class TierStoreError(Exception):
    """Root of every error raised by sglang_tierstore."""


class ConfigError(TierStoreError, ValueError):
    """A configuration key has a bad value, or is unknown."""


class IndexUnavailable(TierStoreError, ConnectionError):
    """The Redis index cannot be reached (down, slow, or backing off)."""


class PageIOError(TierStoreError, OSError):
    """Reading or writing a page file failed."""


class EmbeddedRedisError(TierStoreError, RuntimeError):
    """The embedded redis-server cannot be started."""


class StoreDetached(TierStoreError, RuntimeError):
    """The store this process attached to is not in the index any more (dropped by a
    re-format, or the index was lost): attach again."""


class NoStore(TierStoreError, LookupError):
    """No store to look at: the directories carry no marker, or the index does not hold
    the store they name (an operator's tool found nothing and created nothing)."""


class FileGone(PageIOError):
    """A page file is provably not the one the index describes any more (deleted,
    replaced, truncated): its pages are gone."""


class StoreClosed(TierStoreError, RuntimeError):
    """The store was closed (the backend was detached or the process is shutting down):
    it answers nothing more."""
