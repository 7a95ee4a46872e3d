"""The column names: one constant per declared column, the same names the bus checks."""

from __future__ import annotations

import relax.schema as schema
from relax.bus import SCHEMA
from relax.schema import COLUMN_NAMES


def test_every_declared_column_has_a_constant_and_the_bus_checks_them_all() -> None:
    assert set(SCHEMA) == set(COLUMN_NAMES) and len(COLUMN_NAMES) == len(SCHEMA)
    for name in COLUMN_NAMES:
        assert getattr(schema, name.upper()) == name


def test_the_schema_imports_no_third_party_package() -> None:
    import subprocess
    import sys

    code = (
        "import sys, relax.schema; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'pydantic', 'numpy', 'msgpack')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
