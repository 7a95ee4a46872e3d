"""Imported lazily by ``standby_fixtures.Imported.on_start``, and named in its
``warm_imports``: a spare imports it in advance."""

import time

IMPORTED_AT = time.time()
