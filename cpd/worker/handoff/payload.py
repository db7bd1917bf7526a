"""Payload identity and layout: checksum, host identity, array views, a handle's layout."""
from __future__ import annotations

import socket
from typing import Any

import msgspec
import numpy as np
import xxhash

from cpd.messages.handoff import HandoffHandle
from cpd.worker.handoff.errors import HandoffError


def payload_checksum(view) -> int:
    """xxh3-64 of a staged payload's bytes (any C-contiguous buffer)."""
    return xxhash.xxh3_64_intdigest(view)


def host_identity() -> str:
    """``"<hostname>/<boot id>"``: equal only for processes on the same running kernel."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


def as_numpy(array: Any) -> np.ndarray:
    if isinstance(array, np.ndarray):
        return array
    if hasattr(array, "detach") and hasattr(array, "numpy"):  # torch.Tensor
        return array.detach().cpu().numpy()
    return np.asarray(array)


def bytes_view(a: np.ndarray) -> memoryview:
    return memoryview(a).cast("B") if a.nbytes else memoryview(b"")  # type: ignore[arg-type]  # arrays are buffers


def as_handle(handle: HandoffHandle | dict) -> HandoffHandle:
    """A handle as :class:`HandoffHandle` (a JSON-decoded dict is converted and checked)."""
    if isinstance(handle, HandoffHandle):
        return handle
    try:
        return msgspec.convert(handle, HandoffHandle)
    except msgspec.ValidationError as e:
        raise HandoffError(f"bad handle: {e}") from None


def handle_layout(handle: HandoffHandle) -> tuple[np.dtype, tuple[int, ...], int]:
    """``(dtype, shape, nbytes)`` of a handle, checked for consistency."""
    try:
        dtype = np.dtype(handle.dtype)
    except TypeError as e:
        raise HandoffError(f"bad handle: {e}") from None
    shape, nbytes = tuple(handle.shape), handle.nbytes
    if any(x < 0 for x in shape) or int(np.prod(shape)) * dtype.itemsize != nbytes:
        raise HandoffError("handle nbytes does not match dtype/shape")
    return dtype, shape, nbytes
