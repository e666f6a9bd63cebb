"""A second process with its own TierStoreBackend (used by test_sharing.py).

python proc_backend.py EXTRA_JSON: writes keys 'child0..' from a pool filled with
seed 100, then waits for keys 'parent0..' (seed 200) and checks their bytes.
"""

from __future__ import annotations

import json
import sys
import time

from tierstore_kit.engine import keys
from tierstore_kit.pools import fill, mha_pool, page_bytes, page_indices, storage_config

from sglang_tierstore import TierStoreBackend

N = 32


def main() -> int:
    extra = json.loads(sys.argv[1])
    mine, theirs = mha_pool("page_first"), mha_pool("page_first")
    fill(mine, 100)
    fill(theirs, 200)
    with TierStoreBackend(storage_config(extra), {}) as be:
        be.register_mem_pool_host(mine)
        if be.batch_set_v1(keys(N, "child"), page_indices(range(N), 4)) != [True] * N:
            return 2
        # the shared keys, written by both processes at once
        if be.batch_set_v1(keys(N, "both"), page_indices(range(N), 4)) != [True] * N:
            return 3
        deadline = time.monotonic() + 120
        while be.batch_exists(keys(N, "parent")) != N:
            if time.monotonic() > deadline:
                return 4
            time.sleep(0.05)
        if be.batch_get_v1(keys(N, "parent"), page_indices(range(40, 40 + N), 4)) != [True] * N:
            return 5
        for i in range(N):
            if page_bytes(mine, 40 + i) != page_bytes(theirs, i):
                return 6
    return 0


if __name__ == "__main__":
    sys.exit(main())
