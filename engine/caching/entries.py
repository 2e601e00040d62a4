"""A cached output as bytes, checked on read: a corrupt, truncated or misplaced entry
reads as a miss, never as a wrong answer.

Layout: MAGIC, the dtype's code (3 bytes, numpy's `str`), ndim (1 byte), each dimension
(4 bytes little-endian), the values, then a 16-byte digest of the key and everything
before it (an entry copied under another key fails its check).
"""

from __future__ import annotations

import hashlib

import numpy as np

MAGIC = b"PSC1"
CHECK_BYTES = 16
_DTYPES = {"<f4", "<f2", "<f8", "<i4", "<i8", "|b1"}


def _check(key: bytes, body: bytes | memoryview) -> bytes:
    hasher = hashlib.blake2b(key, digest_size=CHECK_BYTES, person=b"cache-entry")
    hasher.update(body)
    return hasher.digest()


def pack(key: bytes, values: np.ndarray) -> bytes:
    array = np.ascontiguousarray(values)
    if array.dtype.str not in _DTYPES:  # bfloat16 (ml_dtypes) and the like: exact in float32
        array = array.astype(np.float32)
    code = array.dtype.str
    header = MAGIC + code.encode() + bytes([array.ndim])
    header += b"".join(int(n).to_bytes(4, "little") for n in array.shape)
    body = header + array.tobytes()
    return body + _check(key, body)


def unpack(key: bytes, data: bytes | None) -> np.ndarray | None:
    """The stored array (read-only), or None where the entry fails any check."""
    if data is None or len(data) < len(MAGIC) + 4 + CHECK_BYTES or not data.startswith(MAGIC):
        return None
    view = memoryview(data)
    body, check = view[:-CHECK_BYTES], view[-CHECK_BYTES:]
    if _check(key, body) != check:
        return None
    code = bytes(view[4:7]).decode(errors="replace")
    ndim = view[7]
    start = 8 + 4 * ndim
    if code not in _DTYPES or len(body) < start:
        return None
    shape = tuple(int.from_bytes(view[8 + 4 * k : 12 + 4 * k], "little") for k in range(ndim))
    dtype = np.dtype(code)
    if (len(body) - start) != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
        return None
    array = np.frombuffer(body[start:], dtype=dtype).reshape(shape)
    array.flags.writeable = False
    return array
