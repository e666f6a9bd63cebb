"""The ACL a Redis shared with others can give tierstore: a user of its own that may touch
only its keys, with only the commands it sends (``ACL SETUSER <name> on >password <rules>``;
docs/operations.md shows it, deploy/ writes it). A refusal of the index names this module.
"""

from __future__ import annotations

from sglang_tierstore.schema import key_globs

# Every command tierstore sends, its functions' included (Redis checks the commands a function
# calls against its caller's ACL too; EVALSHA and SCRIPT LOAD for servers without functions;
# CLUSTER SLOTS/SHARDS, COMMAND and ASKING for a cluster). INFO is left out: only ``memory_used``
# sends it, for scripts/index_memory.py against an embedded Redis.
ACL_COMMANDS = (
    "fcall", "function|load", "evalsha", "script|load", "multi", "exec", "exists", "unlink", "scan", "set", "get", "del",
    "cluster|slots", "cluster|shards", "command", "asking",
    "hexists", "hget", "hmget", "hgetall", "hvals", "hlen", "hstrlen", "hscan", "hset", "hsetnx", "hincrby", "hdel",
    "zadd", "zcard", "zrange", "zrangebyscore", "zscore", "zrem",
)


def acl_rule(prefix: str) -> str:
    """ACL rules for a Redis user that may do what a tierstore with ``redis_prefix`` needs
    and nothing else: its keys (:func:`~sglang_tierstore.schema.key_globs`), no channels,
    the commands in ``ACL_COMMANDS``. For ``ACL SETUSER <name> on >password <rules>``."""
    keys = " ".join(f"~{g}" for g in key_globs(prefix))
    commands = " ".join(f"+{c}" for c in ACL_COMMANDS)
    return f"resetkeys {keys} resetchannels -@all {commands}"
