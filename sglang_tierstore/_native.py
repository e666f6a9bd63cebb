"""The C helper, imported once for the package.

``pageio`` is ``sglang_tierstore._pageio`` (built from ``_pageio.c`` by ``pip install``), or
None where the package was installed without it (no C compiler): :mod:`.pagefile` then moves
pages and checksums them from Python, and :mod:`.index` lets the GIL go while a round trip
waits for its reply.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

pageio: Optional[ModuleType]
try:
    import sglang_tierstore._pageio as pageio
except ImportError:
    pageio = None
