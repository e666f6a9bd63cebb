"""``python -m sglang_tierstore``: the ``tierstore`` command (:mod:`sglang_tierstore.tools.cli`)."""

import sys

from sglang_tierstore.tools.cli import main

sys.exit(main())
