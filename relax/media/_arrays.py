"""NumPy ``.npy`` / ``.npz`` payloads of media items (never unpickled)."""

from __future__ import annotations

import io
import zipfile
from collections.abc import Sequence

import numpy as np

from relax.media._limits import MediaError


def load_npy(data: bytes, kind: str, name: str) -> np.ndarray:
    """The array of a ``.npy`` payload; ``MediaError`` when it is not one."""
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise MediaError(kind, name, f"corrupt .npy data ({exc})") from None


def load_npz(
    data: bytes, kind: str, name: str, array_keys: Sequence[str], rate_keys: Sequence[str]
) -> tuple[np.ndarray, float | None]:
    """``(array, rate)`` of a ``.npz`` payload: the first of ``array_keys`` present (else the
    first entry that is not a rate), and the first of ``rate_keys`` present (else None)."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as archive:
            keys = list(archive.keys())
            key = next((k for k in array_keys if k in keys), None)
            key = key or next((k for k in keys if k not in rate_keys), None)
            if key is None:
                raise MediaError(kind, name, f".npz archive holds no {'/'.join(array_keys)} array")
            rate = next((float(archive[k]) for k in rate_keys if k in keys), None)
            return archive[key], rate
    except MediaError:
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise MediaError(kind, name, f"corrupt .npz data ({exc})") from None
