"""The space's Lua library: the index's one piece of code, one function per job.

The library is the ``.lua`` files beside this module, one per concern (``core``: what
every call starts with; ``regions``; ``leases``; then the functions: ``writes``,
``sweep``, ``files``, ``inspect``, ``lock``), after a prelude that :func:`schema.lua_prelude`
generates, so every record format is written once, in :mod:`sglang_tierstore.schema`.

It reaches the server in one of two forms, which :class:`~sglang_tierstore.index.RedisIndex`
chooses between:

- a Redis Function library (``FUNCTION LOAD``, then ``FCALL <function>``), where the
  server has functions (Redis >= 7.0, Valkey). The first choice: a library is stored in
  the server's AOF/RDB and replicated, so a restart or a failover to a replica finds it
  loaded (no reload on NOSCRIPT after every restart, and no window where a new master
  answers NOSCRIPT to every writer at once); functions are called by name, so a call sent
  in a pipeline beside others (this project's round trips: :mod:`sglang_tierstore.index.wire`)
  never has to be sent again after a NOSCRIPT; read-only functions are flagged
  ``no-writes``, so they may run on replicas.
- one script per function (the library, then ``return FUNCTIONS[name](KEYS, ARGV)``),
  by EVALSHA and SCRIPT LOAD on NOSCRIPT, where the server answers FCALL with "unknown
  command" (Redis 6, proxies and managed services without functions). Same code, same
  behaviour; each call pays for defining the library's local functions again.

The library's name and its functions' names carry a digest of its code: processes of two
builds sharing one server (a rolling upgrade) each call their own code, never the
other's. An old build's library stays loaded (a few tens of KB) until someone removes it
with ``FUNCTION DELETE``.
"""

from __future__ import annotations

import hashlib
import re
from importlib import resources

from sglang_tierstore.index import Library
from sglang_tierstore.schema import lua_prelude

LUA_FILES = ("core", "regions", "leases", "writes", "sweep", "files", "inspect", "lock")
_REGISTER = re.compile(r"^register\('([a-z_]+)', [a-z_]+(, true)?\)$", re.M)


def _body() -> str:
    parts = [lua_prelude()]
    for name in LUA_FILES:
        parts.append(f"-- {name}.lua\n" + resources.files(__package__).joinpath("lua", f"{name}.lua").read_text())
    return "\n".join(parts)


def build() -> Library:
    body = _body()
    digest = hashlib.sha1(body.encode()).hexdigest()[:12]
    name = f"tierstore_{digest}"
    as_functions = (f"#!lua name={name}\n"
                    "local function register(name, fn, read_only)\n"
                    f"  redis.register_function{{function_name = '{name}_' .. name, callback = fn,"
                    " flags = read_only and {'no-writes'} or {}}\n"
                    "end\n" + body)
    as_script = "local FUNCTIONS = {}\nlocal function register(name, fn) FUNCTIONS[name] = fn end\n" + body
    functions = [m.group(1) for m in _REGISTER.finditer(body)]
    scripts = {f: f"{as_script}\nreturn FUNCTIONS['{f}'](KEYS, ARGV)\n" for f in functions}
    return Library(name, as_functions, scripts)


LIBRARY = build()
