"""Test-only harness: a real `sglang.launch_server` on CPU with a tiny random model.

Never imported by the package. `tiny_model` builds the model and tokenizer at
test time (no hub); `shim/sitecustomize.py` is put on PYTHONPATH so the server
and its scheduler subprocess run HiCache on a CPU-only machine; `server` starts,
queries and stops servers.
"""
