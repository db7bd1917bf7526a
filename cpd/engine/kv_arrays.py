"""Array operations on KV storage, behind one small interface, so that the engine, the L1
:class:`~cpd.engine.kv_pool.KVPool` and the L2 :class:`~cpd.engine.host_pool.HostPool`
run unchanged on torch tensors (the ``torch`` executor) or on numpy arrays (the
``modeled`` executor, which must not import torch).

Layouts are the contract ones (``cpd.engine.connector``): a pool is
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``, one block
``[num_layers, 2, block_size, num_kv_heads, head_dim]``, a request's KV
``[num_layers, 2, num_tokens, num_kv_heads, head_dim]``. Slicing (``x[:, :, a:b]``) is
the same on both kinds of array and is used directly by callers.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np


class KVArrays(Protocol):
    """Allocation, copies and conversions of one kind of KV array."""

    element_size: int  # bytes per element

    def zeros(self, shape: Sequence[int]) -> Any: ...

    def empty(self, shape: Sequence[int], pin_memory: bool = False) -> Any: ...

    def as_array(self, x: Any) -> Any:
        """``x`` (numpy array, torch tensor, nested list) as this kind of array (no copy if it already is)."""

    def copy_into(self, dst: Any, src: Any) -> None:
        """Copy ``src`` (any kind, same shape) into the view ``dst``."""

    def to_numpy(self, x: Any) -> np.ndarray:
        """A contiguous host numpy copy-or-view of ``x``."""

    def gather_tokens(self, kv: Any, blocks: Sequence[int], num_tokens: int) -> Any:
        """``[L, 2, num_tokens, H, D]`` contiguous KV of the first ``num_tokens`` tokens held in
        ``blocks`` (in order) of the pool array ``kv``."""


class NumpyKVArrays:
    """KV arrays as numpy arrays (no torch)."""

    def __init__(self, dtype: str | np.dtype = "float16"):
        self.dtype = np.dtype(dtype)
        self.element_size = self.dtype.itemsize

    def zeros(self, shape: Sequence[int]) -> np.ndarray:
        return np.zeros(tuple(shape), dtype=self.dtype)

    def empty(self, shape: Sequence[int], pin_memory: bool = False) -> np.ndarray:
        return np.empty(tuple(shape), dtype=self.dtype)

    def as_array(self, x: Any) -> np.ndarray:
        if hasattr(x, "detach") and hasattr(x, "numpy"):  # a torch tensor handed in by a caller
            x = x.detach().cpu().numpy()
        return np.asarray(x)

    def copy_into(self, dst: np.ndarray, src: Any) -> None:
        np.copyto(dst, self.as_array(src), casting="unsafe")

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.ascontiguousarray(self.as_array(x))

    def gather_tokens(self, kv: np.ndarray, blocks: Sequence[int], num_tokens: int) -> np.ndarray:
        sel = kv[:, :, list(blocks)]  # [L, 2, nb, bs, H, D] (a copy)
        L, two, nb, bs, H, D = sel.shape
        return np.ascontiguousarray(sel.reshape(L, two, nb * bs, H, D)[:, :, :num_tokens])


class TorchKVArrays:
    """KV arrays as torch tensors of one dtype on one device (imports torch)."""

    def __init__(self, dtype: Any = None, device: Any = "cpu"):
        import torch

        self._torch = torch
        self.dtype = dtype if dtype is not None else torch.float32
        self.device = torch.device(device)
        self.element_size = torch.empty((), dtype=self.dtype).element_size()

    def zeros(self, shape: Sequence[int]) -> Any:
        return self._torch.zeros(tuple(shape), dtype=self.dtype, device=self.device)

    def empty(self, shape: Sequence[int], pin_memory: bool = False) -> Any:
        pin = pin_memory and self._torch.cuda.is_available()
        return self._torch.empty(tuple(shape), dtype=self.dtype, pin_memory=pin)

    def as_array(self, x: Any) -> Any:
        return self._torch.as_tensor(x)

    def copy_into(self, dst: Any, src: Any) -> None:
        dst.copy_(self._torch.as_tensor(src).to(dst.device, dst.dtype))

    def to_numpy(self, x: Any) -> np.ndarray:
        return x.contiguous().cpu().numpy()

    def gather_tokens(self, kv: Any, blocks: Sequence[int], num_tokens: int) -> Any:
        idx = self._torch.as_tensor(list(blocks), dtype=self._torch.int64, device=kv.device)
        sel = kv.index_select(2, idx)  # [L, 2, nb, bs, H, D]
        L, two, nb, bs, H, D = sel.shape
        return sel.reshape(L, two, nb * bs, H, D)[:, :, :num_tokens].contiguous()
