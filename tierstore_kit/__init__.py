"""The checkout's kit: what tests/ and scripts/ share (private Redis/Valkey servers and
clusters, free ports, SGLang host pools, the engine over plain bytes, the CPU harness that
runs a real SGLang server, mounts, statistics, provenance stamps, the committed results'
jobs). Installed beside ``sglang_tierstore`` by ``pip install -e .``, so a script runs with
the package and the ``loadtest`` extra and no test dependency. The runtime never imports
it (tests/test_house.py). Importing the package loads nothing; each module loads what it
needs (``pools`` torch and SGLang, ``servers`` redis-py)."""
