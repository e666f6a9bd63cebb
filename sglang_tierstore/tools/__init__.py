"""The operator tools: ``tierstore`` (:mod:`.cli`), the Prometheus exporter
(:mod:`.exporter`), the index and page-file checks (:mod:`.inspect`), the residency planner
(:mod:`.plan`) and its simulator (:mod:`.predict`). They read the engine's modules; the
runtime SGLang loads (the adapter and the engine) never imports them, so a tool's
dependencies and start-up cost stay out of a server.
"""
