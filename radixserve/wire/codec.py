"""How the messages travel: msgpack, with numpy array fields as extension values whose code names the dtype, so
arrays are raw bytes on the wire and numpy arrays at both ends (no consumer parses bytes). radixserve/wire/messages.py
and plans.py say what the messages are."""
from __future__ import annotations

from typing import Any

import msgspec
import numpy as np


def array(values, dtype: type = np.int32) -> np.ndarray:
    """An array field's value (``int32`` unless told): ``values`` as a numpy array of that dtype, not copied when
    it already is one."""
    return np.asarray(values, dtype=dtype)


# -- arrays on the wire: msgpack extension values, the ext code naming the dtype --------------------------------
_EXT_DTYPES = {1: np.dtype(np.int32), 2: np.dtype(np.float32), 3: np.dtype(np.uint8)}
_EXT_CODES = {dtype: code for code, dtype in _EXT_DTYPES.items()}


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray) and obj.dtype in _EXT_CODES:
        return msgspec.msgpack.Ext(_EXT_CODES[obj.dtype], np.ascontiguousarray(obj).tobytes())
    raise TypeError(f"cannot send {type(obj).__name__} {getattr(obj, 'dtype', '')} between actors")


def _ext_hook(code: int, data: memoryview) -> np.ndarray:
    return np.frombuffer(data, dtype=_EXT_DTYPES[code]).copy()  # data is a view of the frame: keep our own


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is np.ndarray and isinstance(obj, np.ndarray):
        return obj
    raise TypeError(f"expected {kind}, got {type(obj).__name__}")


def encoder() -> msgspec.msgpack.Encoder:
    """The encoder every hop uses (numpy array fields as extension values)."""
    return msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def decoder(kind: Any) -> msgspec.msgpack.Decoder:
    """The decoder of an inbox whose messages are ``kind``: array fields come back as numpy arrays."""
    return msgspec.msgpack.Decoder(kind, ext_hook=_ext_hook, dec_hook=_dec_hook)
