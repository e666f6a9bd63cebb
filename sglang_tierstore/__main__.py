"""``python -m sglang_tierstore``: the ``tierstore`` command (:mod:`sglang_tierstore.cli`)."""

import sys

from sglang_tierstore.cli import main

sys.exit(main())
