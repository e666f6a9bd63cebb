"""A disk that stops answering, for tests: a FUSE passthrough whose reads can be held.

``python3 stallfs.py BACKING MOUNTPOINT [cached]`` mounts BACKING at MOUNTPOINT
(``direct_io``: every read reaches this process, none is served from the page cache; with
``cached``: ``kernel_cache`` instead, so this mount's page cache keeps what it read even
after the backing file changes, as a shared filesystem's client cache may) and takes commands
on stdin, one per line, each answered ``ok`` on stdout:

- ``stall [OP ...]``: operations OP (``read``, the default; ``write``; ``open``: opening
  a file) from now on block (they still reach the kernel and this process, as on a
  device that stopped answering); each prints ``blocked`` when it starts waiting.
- ``answer``: blocked and later operations proceed; each blocked one prints
  ``answered`` once it has been served.

End of stdin (the test ended, or died) answers everything and unmounts. Everything not
stalled passes straight through, so a store can be created, written and opened on it.
The test side is :class:`StalledDisk`.
"""

from __future__ import annotations

import ctypes
import errno
import os
import queue
import subprocess
import sys
import threading
import time
from typing import IO, Any, Optional

MNT_DETACH = 2


class StalledDisk:
    """Runs ``stallfs.py`` over ``backing`` at ``mountpoint`` (test side)."""

    def __init__(self, backing: str, mountpoint: str, cached: bool = False) -> None:
        os.makedirs(backing, exist_ok=True)
        os.makedirs(mountpoint, exist_ok=True)
        self.mountpoint = mountpoint
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), backing, mountpoint,
                                      *(["cached"] if cached else [])],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        threading.Thread(target=self._pump, args=(self.proc.stdout,), daemon=True).start()
        self.blocked = 0
        self.answered = 0
        try:
            self._expect("mounted", 30)
        except BaseException:
            self.close()
            raise

    def _pump(self, out: Optional[IO[str]]) -> None:
        assert out is not None
        for line in out:
            self._lines.put(line.strip())
        self._lines.put("")  # the server exited

    def _expect(self, what: str, timeout_s: float) -> None:
        """Read the server's lines until ``what`` (counting the others)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"stallfs: no {what!r} within {timeout_s} s") from None
            if line == "":
                err = self.proc.stderr.read() if self.proc.stderr else ""
                raise RuntimeError(f"stallfs exited (rc {self.proc.wait()}) before {what!r}: {err}")
            self.blocked += line == "blocked"
            self.answered += line == "answered"
            if line == what:
                return

    def _command(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        self._expect("ok", 10)

    def stall(self, *ops: str) -> None:
        self._command(" ".join(("stall", *ops)))

    def answer(self) -> None:
        self._command("answer")

    def wait_blocked(self, timeout_s: float = 30) -> None:
        """Until a read is held by the stall."""
        while self.blocked == 0:
            self._expect("blocked", timeout_s)

    def wait_answered(self, n: int, timeout_s: float = 30) -> None:
        """Until ``n`` held reads have been served."""
        while self.answered < n:
            self._expect("answered", timeout_s)

    def close(self) -> None:
        """Answer every read, unmount, and wait for the server (killing it if need be:
        the kernel then fails whatever is still pending)."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()  # the server answers all and unmounts
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if os.path.ismount(self.mountpoint):
            _umount(self.mountpoint)


def _umount(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.umount2(path.encode(), MNT_DETACH) != 0 and ctypes.get_errno() not in (errno.EINVAL, errno.ENOENT):
        raise OSError(ctypes.get_errno(), f"umount {path} failed: {os.strerror(ctypes.get_errno())}")


def _serve(backing: str, mountpoint: str, cached: bool) -> None:
    from fuse import FUSE, FuseOSError, Operations  # fusepy over libfuse2: scripts/setup.sh installs both

    answering = threading.Event()
    answering.set()
    stalled: set[str] = set()  # the operations that block while answering is clear
    out_lock = threading.Lock()

    def say(line: str) -> None:
        with out_lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    def control() -> None:
        for line in sys.stdin:
            cmd, *ops = line.split()
            if cmd == "stall":
                stalled.clear()
                stalled.update(ops or ["read"])
                answering.clear()
            elif cmd == "answer":
                answering.set()
            say("ok")
        answering.set()
        _umount(mountpoint)  # FUSE() returns once the kernel lets go of the mount

    class Passthrough(Operations):  # type: ignore[misc]
        def _p(self, path: str) -> str:
            return os.path.join(backing, path.lstrip("/"))

        def init(self, path: str) -> None:
            threading.Thread(target=control, daemon=True).start()
            say("mounted")

        def getattr(self, path: str, fh: Optional[int] = None) -> dict[str, Any]:
            st = os.lstat(self._p(path))
            return {k: getattr(st, k) for k in ("st_mode", "st_ino", "st_nlink", "st_uid", "st_gid", "st_size",
                                                 "st_atime", "st_mtime", "st_ctime", "st_blocks")}

        def access(self, path: str, mode: int) -> None:
            if not os.access(self._p(path), mode):
                raise FuseOSError(errno.EACCES)

        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", "..", *os.listdir(self._p(path))]

        def mkdir(self, path: str, mode: int) -> None:
            os.mkdir(self._p(path), mode)

        def rmdir(self, path: str) -> None:
            os.rmdir(self._p(path))

        def chmod(self, path: str, mode: int) -> None:
            os.chmod(self._p(path), mode)

        def chown(self, path: str, uid: int, gid: int) -> None:
            os.chown(self._p(path), uid, gid)

        def unlink(self, path: str) -> None:
            os.unlink(self._p(path))

        def rename(self, old: str, new: str) -> None:
            os.replace(self._p(old), self._p(new))

        def truncate(self, path: str, length: int, fh: Optional[int] = None) -> None:
            os.truncate(self._p(path), length)

        def utimens(self, path: str, times: Optional[tuple[float, float]] = None) -> None:
            os.utime(self._p(path), times)

        def statfs(self, path: str) -> dict[str, Any]:
            sv = os.statvfs(self._p(path))
            return {k: getattr(sv, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                                                 "f_files", "f_flag", "f_frsize", "f_namemax")}

        def held(self, op: str) -> bool:
            """Block if ``op`` is stalled; whether it was (it then says ``answered`` when done)."""
            if op not in stalled or answering.is_set():
                return False
            say("blocked")
            answering.wait()
            return True

        def open(self, path: str, flags: int) -> int:
            held = self.held("open")
            fh = os.open(self._p(path), flags & ~os.O_DIRECT)
            if held:
                say("answered")
            return fh

        def create(self, path: str, mode: int, fi: Any = None) -> int:
            return os.open(self._p(path), os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            held = self.held("read")
            data = os.pread(fh, size, offset)
            if held:
                say("answered")
            return data

        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            held = self.held("write")
            n = os.pwrite(fh, data, offset)
            if held:
                say("answered")
            return n

        def fsync(self, path: str, datasync: int, fh: int) -> None:
            if datasync:
                os.fdatasync(fh)
            else:
                os.fsync(fh)

        def flush(self, path: str, fh: int) -> None:
            pass

        def release(self, path: str, fh: int) -> None:
            os.close(fh)

    if cached:
        FUSE(Passthrough(), mountpoint, foreground=True, kernel_cache=True, attr_timeout=60, entry_timeout=60)
    else:
        FUSE(Passthrough(), mountpoint, foreground=True, direct_io=True)


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2], sys.argv[3:] == ["cached"])
