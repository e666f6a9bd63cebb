"""Administering one Redis server rather than using the index: whether it guards itself with
a password, waiting while it loads its AOF, shutting it down. For the embedded index's start
and stop (:mod:`sglang_tierstore.embedded`) and an operator's tool that started it; never on
the path of a probe, a read or a write.
"""

from __future__ import annotations

import time as mod_time
from typing import Optional

import redis

from sglang_tierstore.errors import TierStoreError


def password_state(url: str, password: str, timeout_s: float) -> str:
    """Whether the server at ``url`` guards itself with ``password``: ``ok``; ``unset``
    when it answers without any (an embedded Redis that a build before passwords
    started; such a server also accepts any AUTH, so AUTH alone proves nothing);
    ``refused`` when it wants another; ``down`` when nothing answers. Start-up only.

    Any other error reply also answers the question: the server let the connection past
    authentication. A server whose AOF disk is full refuses even PING (MISCONF), and a
    process starting then must still join it (and ride out the refused writes)."""

    def ping(pw: Optional[str]) -> None:
        r = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, password=pw)
        try:
            r.ping()
        except redis.ResponseError:  # past authentication (NOAUTH and WRONGPASS are not ResponseErrors)
            pass
        finally:
            r.close()

    try:
        try:
            ping(None)
            return "unset"
        except redis.AuthenticationError:  # NOAUTH: it wants a password
            ping(password)
            return "ok"
    except redis.AuthenticationError:
        return "refused"
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return "down"


def wait_loaded(url: str, timeout_s: float) -> None:
    """Until the server at ``url`` serves its data, ``timeout_s`` at most: a server that was
    just started answers LOADING while it reads its AOF. For an operator's tool that started
    the embedded index and reads it at once (a serving process does not wait: misses until then)."""
    r = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=None)
    deadline = mod_time.monotonic() + timeout_s
    try:
        while True:
            try:
                r.exists("tierstore:loaded?")  # (PING is answered while loading; a key command is not)
                return
            except redis.BusyLoadingError:
                if mod_time.monotonic() > deadline:
                    return
                mod_time.sleep(0.05)
    finally:
        r.close()


def shutdown_unprotected(url: str, timeout_s: float) -> None:
    """Stop a server that takes no password (it syncs its AOF first, so nothing is lost)."""
    r = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        r.shutdown(nosave=True)
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        pass  # it closed the connection as it went
    except redis.RedisError as e:
        raise TierStoreError(f"redis did not shut down: {e}") from e
    finally:
        r.close()
