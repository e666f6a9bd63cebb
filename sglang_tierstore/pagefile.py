"""Page files: bytes at offsets. Knows files, not keys, regions or the index.

Each of a store's directories holds, for prefix ``P`` and store id ``X``::

    <dir>/tierstore-<P>/store.json          which store this directory belongs to (space.attach)
    <dir>/tierstore-<P>/<X>/store.json      store X's own marker: its store and directory ids
    <dir>/tierstore-<P>/<X>/f000012.pages   page file 12 of store X

A page file is a 4 KiB header (JSON: the store's identity, file number and uid) and then
the store's regions (:mod:`sglang_tierstore.space.geometry`); it is created at its full
size, sparse, so its size never changes (a reader on another node of a shared filesystem
never sees a length that lags a writer's). Which directory holds file
``n`` and which uid it carries are the index's (a :class:`FileRef` the space layer hands
down with every call), never derived from the list of directories, so adding or removing
a directory moves nothing, and nothing here ever asks the index.

A file is opened only if its header names the store, number and uid of its ref.
Deleting or replacing a file is noticed on open, and by :meth:`PageFiles.still_there`
(its path must still lead to the inode we use): :class:`FileGone`, which the space layer
acts on only once :meth:`PageFiles.identified` shows the directory is the store's (its
own marker readable and naming it, its filesystem the one seen at start): an unmounted
share, a directory that is briefly not there, a cache that lags another node are misses,
never a file declared lost for the whole fleet. A short read is a miss too. Every other
failure (EMFILE, ENOMEM, EIO, EACCES...) is a :class:`PageIOError`: a miss or a failed
write that leaves the index alone.

A slot holds the page's bytes and nothing else, so a run of pages in adjacent slots
moves in one ``preadv``/``pwritev``. The index vouches for what a slot holds: its
entry carries the xxh3 checksum of the bytes. :meth:`PageFiles.transfer` moves a claim
of runs and checksums the pages moved, all in one release of the GIL where the package
was built with its C helper (``_pageio``), and run by run from Python where it was not.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import re
import threading
from contextlib import contextmanager
from typing import Iterator, Mapping, NamedTuple, Optional, Sequence, Union

import xxhash

import sglang_tierstore._native as _native  # the C helper, looked up on each use (tests take it away)
from sglang_tierstore.errors import FileGone, PageIOError
from sglang_tierstore.filesystem import cached_range, drop_cached, fallocate, fsid, shared_fs
from sglang_tierstore.perms import PRIVATE, Modes, create_file
from sglang_tierstore.schema import ALIGN, HEADER_BYTES

MARKER = "store.json"  # a store directory's own marker (written by space.attach)

MAGIC = "tierstore-pages"
_FILE_RE = re.compile(r"^f(\d{6,})\.pages$")

READ, WRITE, HASH = 0, 1, 2  # what a Transfer does (the C helper's numbers)
_SKIP = 3  # (the C helper's no-op: an op whose file could not be opened)
_READ_ONLY = "these page files are open for reading only"
assert _native.pageio is None or (_native.pageio.READ, _native.pageio.WRITE, _native.pageio.HASH,
                                  _native.pageio.SKIP) == (READ, WRITE, HASH, _SKIP)


def checksum(regions: Sequence[memoryview]) -> int:
    """xxh3-64 of the concatenated ``regions``."""
    if len(regions) == 1:
        return xxhash.xxh3_64_intdigest(regions[0])
    h = xxhash.xxh3_64()
    for r in regions:
        h.update(r)
    return h.intdigest()


def checksums(bufs: Sequence[memoryview], spans: Sequence[int]) -> list[int]:
    """The checksum of each span: consecutive byte counts over the concatenated ``bufs``."""
    out: list[int] = []
    rest = iter(bufs)
    cur = memoryview(b"")
    for n in spans:
        parts = []
        while n:
            while not len(cur):
                cur = next(rest)
            parts.append(cur[:n])
            n -= len(parts[-1])
            cur = cur[len(parts[-1]):]
        out.append(checksum(parts))
    return out


class FileRef(NamedTuple):
    """Which page file to use: its number, the directory (id) holding it, its uid."""

    number: int
    dir_id: str
    uid: str


class Transfer(NamedTuple):
    """One operation of a claim: a ``READ`` (preadv) or ``WRITE`` (pwritev) of ``nbytes`` at
    ``offset`` of page file ``ref`` through ``bufs`` (adjacent slots; ``aligned``: every
    buffer 4 KiB aligned, so O_DIRECT may be used), or ``HASH`` (no I/O, no file); then the
    checksum of each of ``spans`` (byte counts, consecutive from the start of ``bufs``: a
    run's pages) once every byte has moved."""

    kind: int
    ref: Optional[FileRef]
    offset: int
    bufs: Sequence[memoryview]
    nbytes: int
    aligned: bool
    spans: Sequence[int]


Moved = Union[list[int], Exception]  # a Transfer's outcome: its spans' checksums, or why it failed


class _Open:
    """An open page file. Its fds close when it has been forgotten and the last I/O
    using it has ended (never under a running preadv/pwritev: the number could be reused)."""

    __slots__ = ("fd", "dfd", "ino", "path", "users", "retired")

    def __init__(self, fd: int, dfd: int, ino: int, path: str) -> None:
        self.fd, self.dfd, self.ino, self.path = fd, dfd, ino, path
        self.users = 0
        self.retired = False

    def close(self) -> None:
        for f in (self.fd, self.dfd):
            if f >= 0:
                os.close(f)


class PageFiles:
    """Open page files of one store, positioned I/O of runs of slots."""

    @property
    def native(self) -> bool:
        """Whether :meth:`transfer` runs through the C helper: it is built, and this class
        moves bytes by :class:`PageFiles`' own :meth:`read` and :meth:`write` (a subclass that
        intercepts them gets every run through them)."""
        cls = type(self)
        return _native.pageio is not None and cls.read is PageFiles.read and cls.write is PageFiles.write

    def __init__(self, identity: Mapping[str, object], dirs: Mapping[str, str], o_direct: bool,
                 modes: Modes = PRIVATE, read_only: bool = False, shared: Optional[bool] = False) -> None:
        """``identity``: what every file's header says of the store (prefix, store id,
        geometry); ``dirs``: directory id -> the store's directory there (made by
        attaching); ``read_only``: files are opened for reading only (an operator's tool,
        which may read a store it may not write), and anything that would change one is a
        PageIOError. ``shared``: the directories are on a filesystem other nodes write too
        (None: detected, :func:`.filesystem.shared_fs`): buffered reads drop the range from the page
        cache first (another node may have rewritten it), and :meth:`read_uncached` is there
        for a page that fails its checksum."""
        self.shared = any(shared_fs(d) for d in dirs.values()) if shared is None else shared
        self.modes = modes
        self.identity = dict(identity)
        self.dirs = dict(dirs)
        self._fsids = {d: fsid(p) for d, p in self.dirs.items()}  # each directory's filesystem, as seen at start
        self.o_direct = o_direct and hasattr(os, "O_DIRECT")
        self.read_only = read_only
        self._open: dict[int, _Open] = {}
        self._opening: dict[int, tuple[threading.Event, str]] = {}  # files being opened (outside the lock), and where
        self._forgotten: dict[int, bool] = {}  # files forgotten while being opened
        self._lock = threading.Lock()
        self._closed = False

    def _writable(self, what: str) -> None:
        if self.read_only:
            raise PageIOError(errno.EROFS, f"{what}: {_READ_ONLY}")

    # -- naming --------------------------------------------------------------------

    def path(self, file_no: int, dir_id: str) -> str:
        return os.path.join(self.dirs[dir_id], f"f{file_no:06d}.pages")

    def header(self, ref: FileRef) -> bytes:
        doc = {"magic": MAGIC, **self.identity, "file": ref.number, "uid": ref.uid}
        raw = json.dumps(doc, sort_keys=True).encode()
        return raw + b"\0" * (HEADER_BYTES - len(raw))

    # -- files -----------------------------------------------------------------------

    def create(self, ref: FileRef) -> None:
        """Write a new page file (header only; regions get space when allocated).
        Anything left at its path is not in the index, so it is replaced."""
        self._writable(f"cannot create page file {ref.number}")
        final = self.path(ref.number, ref.dir_id)
        tmp = f"{final}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            fd = create_file(tmp, self.modes, os.O_RDWR)
            try:
                os.pwrite(fd, self.header(ref), 0)
                os.ftruncate(fd, self.file_bytes())  # full size, sparse: regions get space when allocated
                os.fdatasync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise PageIOError(e.errno, f"cannot create page file {final}: {e.strerror}") from e

    def file_bytes(self) -> int:
        """A page file's size: its header and all its regions."""
        return HEADER_BYTES + int(str(self.identity["regions_per_file"])) * int(str(self.identity["region_bytes"]))

    def identified(self, dir_id: str) -> bool:
        """Whether the store's directory ``dir_id`` is provably there: its own marker readable
        and naming this store and directory, on the filesystem seen at start. Only then does
        a file missing from it prove the file gone (see the module docstring)."""
        d = self.dirs.get(dir_id)
        if d is None:
            return False
        try:
            with open(os.path.join(d, MARKER)) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            return False
        return (isinstance(doc, dict) and doc.get("store") == self.identity.get("store") and doc.get("dir") == dir_id
                and fsid(d) == self._fsids.get(dir_id))

    def heartbeat(self) -> None:
        """Touch each store directory's own marker: a store in use shows a recent time there,
        even when only read (``tierstore gc`` leaves it alone)."""
        for d in self.dirs.values():
            try:
                os.utime(os.path.join(d, MARKER))
            except OSError:
                pass

    def remove(self, file_no: int, dir_id: str) -> None:
        """Remove a file the index does not (or no longer) account for."""
        self._writable(f"cannot remove page file {file_no}")
        path = self.path(file_no, dir_id)
        self.forget(file_no, path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise PageIOError(e.errno, f"cannot remove {path}, which the index does not account for: {e.strerror}") from e

    @contextmanager
    def _using(self, ref: FileRef) -> Iterator[_Open]:
        """An open handle, held for the duration of one I/O."""
        h = self._hold(ref)
        try:
            yield h
        finally:
            self._let_go(h)

    def _hold(self, ref: FileRef) -> _Open:
        """An open handle, counted as a user until :meth:`_let_go`."""
        with self._lock:
            h = self._open.get(ref.number)
            if h is not None:
                h.users += 1
                return h
        return self._handle(ref)

    def _let_go(self, h: _Open) -> None:
        with self._lock:
            h.users -= 1
            last = h.retired and h.users == 0
        if last:
            h.close()

    def _handle(self, ref: FileRef) -> _Open:
        """Open a file (counted as one user). The open and the header read run outside
        the lock, so a file whose first open stalls (a stalled disk, a slow mount) holds
        up only I/O on that file; threads wanting the same file wait for the one opening
        it, then look again."""
        while True:
            with self._lock:
                h = self._open.get(ref.number)
                if h is not None:
                    h.users += 1
                    return h
                if self._closed:
                    raise PageIOError(errno.EBADF, f"page file {ref.number} not opened: the store is closed")
                if ref.dir_id not in self.dirs:
                    raise PageIOError(errno.ENOENT, f"page file {ref.number} lives in directory {ref.dir_id}, which this process does not have")
                pending = self._opening.get(ref.number)
                if pending is None:
                    opening = threading.Event()
                    self._opening[ref.number] = (opening, self.path(ref.number, ref.dir_id))
                    break
            pending[0].wait()
        try:
            h = self._open_file(ref)
        except BaseException:
            with self._lock:
                del self._opening[ref.number]
                self._forgotten.pop(ref.number, None)
            opening.set()
            raise
        with self._lock:
            del self._opening[ref.number]
            gone = self._closed or self._forgotten.pop(ref.number, False)
            if not gone:
                h.users = 1
                self._open[ref.number] = h
        opening.set()
        if gone:  # closed, or forgotten while it was being opened: this I/O fails, nothing is lost
            h.close()
            raise PageIOError(errno.EAGAIN, f"page file {h.path} was closed or forgotten while it was being opened")
        return h

    def _open_file(self, ref: FileRef) -> _Open:
        path = self.path(ref.number, ref.dir_id)
        mode = os.O_RDONLY if self.read_only else os.O_RDWR
        try:
            fd = os.open(path, mode | os.O_CLOEXEC)
        except FileNotFoundError as e:
            raise FileGone(errno.ENOENT, f"page file {path} was deleted") from e
        except IsADirectoryError as e:
            raise FileGone(errno.EISDIR, f"page file {path} was replaced by a directory") from e
        except OSError as e:
            raise PageIOError(e.errno, f"cannot open page file {path}: {e.strerror}") from e
        try:
            self._check_header(fd, path, ref)
            dfd = -1
            if self.o_direct:
                try:
                    dfd = os.open(path, mode | os.O_DIRECT | os.O_CLOEXEC)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise PageIOError(e.errno, f"cannot open {path}: {e.strerror}") from e
            try:
                return _Open(fd, dfd, os.fstat(fd).st_ino, path)
            except BaseException:
                if dfd >= 0:
                    os.close(dfd)
                raise
        except BaseException:
            os.close(fd)
            raise

    def _check_header(self, fd: int, path: str, ref: FileRef) -> None:
        try:
            raw = os.pread(fd, HEADER_BYTES, 0)
        except OSError as e:
            raise PageIOError(e.errno, f"cannot read the header of {path}: {e.strerror}") from e
        if raw != self.header(ref):
            if len(raw) < HEADER_BYTES or not raw.strip(b"\0"):  # a client whose data lags: proves nothing (a miss)
                raise PageIOError(errno.EIO, f"the header of {path} is not readable yet ({len(raw)} bytes)")
            raise FileGone(errno.ESTALE, f"{path} is not page file {ref.number} (uid {ref.uid}) of store {self.identity.get('store')}")

    def ensure_open(self, ref: FileRef) -> None:
        """Open a file now (raising FileGone if it is not the one the ref names)."""
        with self._using(ref):
            pass

    def forget(self, file_no: int, path: Optional[str] = None) -> None:
        """Close a file (it is gone, or is being removed) once no I/O uses it; with
        ``path``, only if that is the file open (a stray copy of that number elsewhere is
        not the file in use)."""
        with self._lock:
            opening = self._opening.get(file_no)
            if opening is not None and (path is None or opening[1] == path):
                self._forgotten[file_no] = True
            h = self._open.get(file_no)
            if h is None or (path is not None and h.path != path):
                return
            del self._open[file_no]
            h.retired = True
            last = h.users == 0
        if last:
            h.close()

    def still_there(self, file_no: int) -> None:
        """Raise FileGone if the file's path no longer leads to the inode we use."""
        with self._lock:
            h = self._open.get(file_no)
        if h is None:
            return
        try:
            ino = os.stat(h.path).st_ino
        except FileNotFoundError:
            ino = -1
        except OSError as e:
            raise PageIOError(e.errno, f"cannot stat {h.path}: {e.strerror}") from e
        if ino != h.ino:
            raise FileGone(errno.ESTALE, f"page file {h.path} was deleted or replaced")

    def open_files(self) -> list[int]:
        with self._lock:
            return list(self._open)

    # -- space -------------------------------------------------------------------------

    def allocate(self, ref: FileRef, offset: int, nbytes: int) -> None:
        """Give a range of a file disk space (it was a hole)."""
        self._writable(f"cannot allocate space in page file {ref.number}")
        with self._using(ref) as h:
            if e := fallocate(h.fd, offset, nbytes):
                raise PageIOError(e, f"cannot allocate {nbytes} bytes at {offset} in {h.path}: {os.strerror(e)}")

    def punch(self, ref: FileRef, offset: int, nbytes: int) -> None:
        """Return a range's disk space (it became a hole)."""
        self._writable(f"cannot punch page file {ref.number}")
        with self._using(ref) as h:
            if e := fallocate(h.fd, offset, nbytes, punch=True):
                raise PageIOError(e, f"cannot punch {nbytes} bytes at {offset} out of {h.path}: {os.strerror(e)}")

    # -- I/O ---------------------------------------------------------------------------

    def transfer(self, ops: Sequence[Transfer], stop: Sequence[bytearray] = ()) -> list[Moved]:
        """Run ``ops`` in order; the outcome of each: its spans' checksums, or the
        :class:`PageIOError` (:class:`FileGone`) it met, as :meth:`read` and :meth:`write`
        raise them. Outcomes of a prefix of ``ops``: before each op but the first, this
        stops once a ``stop`` flag (a bytearray's first byte) is set. With the C helper
        the whole claim runs in one release of the GIL (only opening a file not open yet
        takes Python); without it, op by op through :meth:`read` and :meth:`write`."""
        helper = _native.pageio
        if helper is None or not self.native:
            return self._transfer_each(ops, stop)
        held: dict[int, Union[_Open, PageIOError]] = {}  # each file the claim uses, opened once (or why not)
        failed: dict[int, PageIOError] = {}
        paths: list[str] = []
        calls: list[tuple[int, int, int, Sequence[memoryview], Sequence[int], int, int]] = []
        try:
            for i, op in enumerate(ops):
                paths.append("")
                if op.kind == HASH:
                    calls.append((HASH, -1, 0, op.bufs, op.spans, 0, 0))
                    continue
                assert op.ref is not None
                h = held.get(op.ref.number)
                if op.kind == WRITE and self.read_only:
                    h = PageIOError(errno.EROFS, f"cannot write page file {op.ref.number}: {_READ_ONLY}")
                elif h is None:
                    try:
                        h = held[op.ref.number] = self._hold(op.ref)
                    except PageIOError as e:
                        h = held[op.ref.number] = e
                if isinstance(h, PageIOError):
                    failed[i] = h
                    calls.append((_SKIP, -1, 0, (), (), 0, 0))
                    continue
                fd = h.dfd if op.aligned and h.dfd >= 0 else h.fd
                lo, n = cached_range(op.offset, op.nbytes) if op.kind == READ and self.shared and fd == h.fd else (0, 0)
                paths[i] = h.path
                calls.append((op.kind, fd, op.offset, op.bufs, op.spans, lo, n))
            done = helper.transfer(calls, stop)
        finally:
            for h in held.values():
                if isinstance(h, _Open):
                    self._let_go(h)
        out: list[Moved] = []
        for i, (op, (err, n, sums)) in enumerate(zip(ops, done)):
            verb = "read" if op.kind == READ else "write"
            if i in failed:
                out.append(failed[i])
            elif err:
                out.append(PageIOError(err, f"{verb} at {op.offset} of {paths[i]} failed: {os.strerror(err)}"))
            elif op.kind != HASH and n != op.nbytes:
                out.append(_short(verb, op.offset, paths[i], n, op.nbytes))
            else:
                out.append(list(sums))
        return out

    def _transfer_each(self, ops: Sequence[Transfer], stop: Sequence[bytearray]) -> list[Moved]:
        out: list[Moved] = []
        for op in ops:
            if out and any(f[0] for f in stop):
                break
            try:
                if op.kind == READ:
                    self.read(op.ref, op.offset, op.bufs, op.nbytes, op.aligned)  # type: ignore[arg-type]
                elif op.kind == WRITE:
                    self.write(op.ref, op.offset, op.bufs, op.nbytes, op.aligned)  # type: ignore[arg-type]
                out.append(checksums(op.bufs, op.spans))
            except PageIOError as e:  # what the C helper reports too (anything else is a bug: the engine
                out.append(e)  # gives it to every op of the claim)
        return out

    def read(self, ref: FileRef, offset: int, bufs: Sequence[memoryview], nbytes: int, aligned: bool) -> None:
        """Read ``nbytes`` at ``offset`` into ``bufs`` (adjacent slots) with one preadv."""
        with self._using(ref) as h:
            fd = h.dfd if aligned and h.dfd >= 0 else h.fd
            try:
                if self.shared and fd == h.fd:  # what this node's cache may still hold of it (best effort)
                    drop_cached(fd, *cached_range(offset, nbytes))
                n = os.preadv(fd, bufs, offset)
            except OSError as e:
                raise PageIOError(e.errno, f"read at {offset} of {h.path} failed: {e.strerror}") from e
        if n != nbytes:  # files never change size: a filesystem that shows a lagging length (a miss, nothing dropped)
            raise _short("read", offset, h.path, n, nbytes)

    def read_uncached(self, ref: FileRef, offset: int, nbytes: int) -> bytes:
        """The bytes at ``offset`` as the filesystem has them now, not as this node's page
        cache kept them: for a page that failed its checksum on a shared filesystem, before
        anything is dropped."""
        with self._using(ref) as h:
            try:
                if h.dfd >= 0:  # O_DIRECT: the page cache is not consulted at all
                    length = (nbytes + ALIGN - 1) // ALIGN * ALIGN
                    buf = mmap.mmap(-1, length)  # page-aligned
                    try:
                        n = os.preadv(h.dfd, [buf], offset)
                        return bytes(buf[: min(n, nbytes)])
                    finally:
                        buf.close()
                drop_cached(h.fd, *cached_range(offset, nbytes))
                return os.pread(h.fd, nbytes, offset)
            except OSError as e:
                raise PageIOError(e.errno, f"read at {offset} of {h.path} failed: {e.strerror}") from e

    def write(self, ref: FileRef, offset: int, bufs: Sequence[memoryview], nbytes: int, aligned: bool) -> None:
        """Write ``bufs`` (``nbytes``, adjacent slots) at ``offset`` with one pwritev."""
        self._writable(f"cannot write page file {ref.number}")
        with self._using(ref) as h:
            fd = h.dfd if aligned and h.dfd >= 0 else h.fd
            try:
                n = _pwritev_all(fd, bufs, offset, nbytes)
            except OSError as e:
                raise PageIOError(e.errno, f"write at {offset} of {h.path} failed: {e.strerror}") from e
        if n != nbytes:
            raise _short("write", offset, h.path, n, nbytes)

    def sync(self, ref: FileRef) -> None:
        with self._using(ref) as h:
            try:
                os.fdatasync(h.fd)
            except OSError as e:
                raise PageIOError(e.errno, f"fdatasync of {h.path} failed: {e.strerror}") from e

    # -- listing -----------------------------------------------------------------------

    def on_disk(self) -> dict[int, list[tuple[str, str]]]:
        """Page files (regular files named like one) in our directories:
        number -> [(directory id, path)]."""
        out: dict[int, list[tuple[str, str]]] = {}
        for dir_id, d in self.dirs.items():
            try:
                entries = list(os.scandir(d))
            except FileNotFoundError:
                continue
            for entry in entries:
                m = _FILE_RE.match(entry.name)
                if m and entry.is_file(follow_symlinks=False):
                    out.setdefault(int(m.group(1)), []).append((dir_id, entry.path))
        return out

    def close(self) -> None:
        """Close every file (each once its last I/O has ended); none opens again."""
        with self._lock:
            self._closed = True
            files = list(self._open)
        for f in files:
            self.forget(f)


def _short(verb: str, offset: int, path: str, n: int, nbytes: int) -> PageIOError:
    return PageIOError(errno.EIO, f"short {verb} at {offset} of {path} ({n} of {nbytes} bytes)")


def _pwritev_all(fd: int, bufs: Sequence[memoryview], off: int, length: int) -> int:
    """pwritev, finishing a partial write (signal, near-full disk) with pwrite."""
    n = os.pwritev(fd, bufs, off)
    if n == length or n <= 0:
        return n
    rest = b"".join(bytes(b) for b in bufs)[n:]
    return n + os.pwrite(fd, rest, off + n)
