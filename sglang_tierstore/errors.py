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


class StoreUnavailable(TierStoreError, ConnectionError):
    """The store cannot be used now (its index, or its directories): a condition a cache
    rides out with misses and failed writes until it clears. ``kind`` names it in the
    error counters (``tierstore_errors_total{kind}``)."""

    kind = "store_unavailable"


class IndexUnavailable(StoreUnavailable):
    """The Redis index cannot be reached (down, slow, or backing off)."""

    kind = "index_unavailable"


class IndexRefusesWrites(IndexUnavailable):
    """The index answers reads but refuses writes: full (``maxmemory`` with noeviction:
    kind ``index_full``), or read-only (a replica, a persistence error: ``index_read_only``)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class StoreDirsUnavailable(StoreUnavailable):
    """The store's directories cannot take what attaching writes (a full disk, EIO)."""

    kind = "disk_unavailable"


class IndexRefusesUser(TierStoreError, PermissionError):
    """The index refuses this user a command its ACL lacks (``sglang_tierstore.index.acl.acl_rule``
    lists what tierstore sends): a start-up that meets it stops, naming the rule; a call
    answers misses and failed writes, counted under ``kind``, until an operator grants it."""

    kind = "index_acl"


class PageIOError(TierStoreError, OSError):
    """Reading or writing a page file failed."""


class EmbeddedRedisError(TierStoreError, RuntimeError):
    """The embedded redis-server cannot be used as configured (no binary to run, a socket
    served by another user, a server wanting another password)."""


class EmbeddedNotStarted(EmbeddedRedisError):
    """Starting the embedded redis-server failed this time (it exited, or did not listen
    in time): the backend comes up answering misses on ``url`` and tries again."""

    def __init__(self, msg: str, url: str) -> None:
        super().__init__(msg)
        self.url = url  # with the password: never log it


class StoreDetached(TierStoreError, RuntimeError):
    """The store this process attached to is not in the index any more (dropped by a
    re-format, or the index was lost): attach again."""


class NoStore(TierStoreError, LookupError):
    """No store to look at: the directories carry no marker, or the index does not hold
    the store they name (an operator's tool found nothing and created nothing)."""


class AttachBusy(StoreUnavailable):
    """Another process is attaching to the store (it holds the attach lock): this one
    answers misses and tries again at its next housekeeping pass."""

    kind = "attach_busy"


class NoStoreYet(StoreUnavailable):
    """No store yet: a serving process creates it once it knows the size of the pages it
    will hold (its first namespace)."""

    kind = "no_store_yet"


class FileGone(PageIOError):
    """A page file is provably not the one the index describes any more (deleted,
    replaced, truncated): its pages are gone."""


class StoreClosed(TierStoreError, RuntimeError):
    """The store was closed (the backend was detached or the process is shutting down):
    it answers nothing more."""
