"""Code run as another user: a forked child of the suite (which runs as root) that drops to
a uid, gid and groups before calling a function, as a service user or an operator would run.

The child calls only code this process has imported already: after the switch it may not be
able to read the interpreter's own files (they may live under a 0700 home)."""

from __future__ import annotations

import os
import pickle
from typing import Any, Callable, Sequence, TypeVar

import pytest

T = TypeVar("T")
NOBODY = 65534
as_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as other users")


def run_as(uid: int, gid: int, fn: Callable[..., T], *args: Any, groups: Sequence[int] = ()) -> T:
    """``fn(*args)`` as ``uid``:``gid`` with supplementary ``groups``; its result (pickled
    back), or AssertionError carrying the exception it raised."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the suite
        out: tuple[bool, Any]
        try:
            os.close(r)
            os.setgroups(list(groups))
            os.setgid(gid)
            os.setuid(uid)
            out = (True, fn(*args))
        except BaseException as e:  # noqa: BLE001 - carried to the parent whatever it is
            out = (False, f"{type(e).__name__}: {e}")
        with os.fdopen(w, "wb") as f:
            pickle.dump(out, f)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    ok, value = pickle.loads(data)
    if not ok:
        raise AssertionError(f"as uid {uid}: {value}")
    return value  # type: ignore[no-any-return]
