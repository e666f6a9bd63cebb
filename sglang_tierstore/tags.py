"""Entry tags: whoever can write to the index still cannot choose which page a key reads.

An entry names the slot a key's page lives in and the checksum of its bytes. With the
checksum alone, anyone who can write to Redis could copy key A's entry into key B's
field: B would then be served A's page, which hashes right. So every entry also
carries a tag, keyed BLAKE2b-128 over (entry field = namespace id + key, region,
region generation, slot, checksum), under a per-store key that lives in a file beside
the page files (mode 0600, or 0640 with ``file_access: group``) and never in Redis.
Someone who can write to the index but cannot read the page directory cannot make a
valid tag: a forged or moved entry reads as a miss and is dropped. A replayed old
entry carries a valid tag, but it names a slot that either still holds the bytes
written for that key or now holds others (a miss: the checksum).

16-byte tags: a forger's only oracle is whether a read drops the entry, one guess per
read, so 2^-128 per guess is far beyond reach. The key is per store: a dropped and
re-created store starts with a new key, so entries of the old one never verify.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
from typing import Iterable, Sequence

from sglang_tierstore.errors import ConfigError
from sglang_tierstore.perms import Modes, write_file
from sglang_tierstore.schema import ENTRY_HEAD, SIGNED_BYTES, TAG_BYTES

_SIGNED = struct.Struct(ENTRY_HEAD.format + "Q")  # the head, then the page's checksum: what a tag covers
assert _SIGNED.size == SIGNED_BYTES

KEY_FILE = "entry.key"
KEY_BYTES = 32


class EntryTags:
    """Makes and checks entry tags under one store's key."""

    def __init__(self, key: bytes) -> None:
        self._h = hashlib.blake2b(key=key, digest_size=TAG_BYTES)  # keyed once; copied per tag

    def tag(self, field: bytes, signed: bytes) -> bytes:
        """The tag of an entry: ``signed`` is its value up to the tag (``SIGNED_BYTES``)."""
        h = self._h.copy()
        h.update(field)
        h.update(signed)
        return h.digest()

    def tails(self, fields: Iterable[bytes], places: Iterable[tuple[int, int, int, int]]) -> list[bytes]:
        """Each entry after its head, as a writer sends it (the page's checksum and the
        tag), for ``fields`` placed at (region, gen, slot, checksum): the hot path's one
        loop over a batch's pages."""
        pack, keyed, head = _SIGNED.pack, self._h, ENTRY_HEAD.size
        out = []
        for field, place in zip(fields, places, strict=True):
            signed = pack(*place)
            h = keyed.copy()
            h.update(field)
            h.update(signed)
            out.append(signed[head:] + h.digest())
        return out

    def valid(self, field: bytes, value: bytes) -> bool:
        return hmac.compare_digest(self.tag(field, value[:SIGNED_BYTES]), value[SIGNED_BYTES:])


def _keys_in(store_dirs: Sequence[str], m: Modes | None) -> dict[str, bytes]:
    """The key files found in the store's directories (``m``: set their mode too)."""
    found: dict[str, bytes] = {}
    for d in store_dirs:
        path = os.path.join(d, KEY_FILE)
        try:
            with open(path, "rb") as f:
                key = f.read()
        except FileNotFoundError:
            continue
        except OSError as e:
            raise ConfigError(f"tierstore config key 'path': cannot read the store's entry key {path} ({e.strerror})") from None
        if len(key) != KEY_BYTES:
            raise ConfigError(f"tierstore config key 'path': {path} is not an entry key ({len(key)} bytes, expected {KEY_BYTES})")
        if m is not None:
            os.chmod(path, m.file)
        found[path] = key
    if len(set(found.values())) > 1:
        raise ConfigError(f"tierstore config key 'path': the store's directories hold different entry keys "
                          f"({', '.join(sorted(found))}); remove the wrong one(s) (their pages then read as misses)")
    return found


def load_key(store_dirs: Sequence[str], m: Modes) -> bytes:
    """The store's key, from its directories; made if none has one, and written into each
    directory that lacks it (two directories holding different keys is an error: the
    files were tampered with or mixed up). Runs under attach's lock on every directory."""
    found = _keys_in(store_dirs, m)
    key = next(iter(found.values())) if found else secrets.token_bytes(KEY_BYTES)
    for d in store_dirs:
        if os.path.join(d, KEY_FILE) not in found:
            write_file(os.path.join(d, KEY_FILE), key, m)
    return key


def read_key(store_dirs: Sequence[str]) -> bytes:
    """The store's key, read and changed nowhere (operators' tools); ConfigError if none
    of the directories holds one."""
    found = _keys_in(store_dirs, None)
    if not found:
        raise ConfigError(f"tierstore config key 'path': none of {', '.join(store_dirs) or 'the directories'} holds the "
                          f"store's entry key ({KEY_FILE}), or this user cannot read it")
    return next(iter(found.values()))
