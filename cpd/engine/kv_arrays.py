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

    def gather_tokens_into(self, kv: Any, blocks: Sequence[int], num_tokens: int, out: Any) -> Any:
        """Write the first ``num_tokens`` tokens' KV of ``blocks`` into ``out`` (an array of this
        kind, or any writable buffer, of exactly ``[L, 2, num_tokens, H, D]`` elements of this
        dtype); returns it as this kind of array."""

    def scatter_tokens(self, kv: Any, blocks: Sequence[int], src: Any) -> None:
        """Write ``src`` ``[L, 2, n, H, D]`` (any kind) into the first ``n`` token slots of
        ``blocks`` (in order) of the pool array ``kv``."""


def _gather_into(take, kv: Any, blocks: Sequence[int], num_tokens: int, out: Any) -> None:
    """Shared body of ``gather_tokens_into``: one gather per (layer, K/V) straight into
    ``out`` for the full blocks, one copy for the partial last block. ``take(src, idx, dst)``
    gathers rows ``idx`` of ``src`` into ``dst``."""
    L, two, _, bs, H, D = kv.shape
    nf, rem = divmod(num_tokens, bs)
    blocks = list(blocks)
    if nf:
        for layer in range(L):
            for i in range(two):
                take(kv[layer, i], blocks[:nf], out[layer, i, :nf * bs].reshape(nf, bs, H, D))
    if rem:
        out[:, :, nf * bs:num_tokens] = kv[:, :, blocks[nf], :rem]


def _scatter(put, kv: Any, blocks: Sequence[int], src: Any) -> None:
    """Shared body of ``scatter_tokens``: the full blocks of ``src`` ``[L, 2, n, H, D]`` in one
    indexed write per (layer, K/V), the partial last block in one copy."""
    L, two, _, bs, H, D = kv.shape
    n = src.shape[2]
    nf, rem = divmod(n, bs)
    blocks = list(blocks)
    if nf:
        for layer in range(L):
            for i in range(two):
                put(kv[layer, i], blocks[:nf], src[layer, i, :nf * bs].reshape(nf, bs, H, D))
    if rem:
        kv[:, :, blocks[nf], :rem] = src[:, :, nf * bs:n]


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
        np.copyto(dst, src if type(src) is np.ndarray else self.as_array(src), casting="unsafe")

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.ascontiguousarray(self.as_array(x))

    def gather_tokens_into(self, kv: np.ndarray, blocks: Sequence[int], num_tokens: int, out: Any) -> np.ndarray:
        """Write the first ``num_tokens`` tokens' KV of ``blocks`` into ``out`` (a writable buffer
        of exactly ``[L, 2, num_tokens, H, D]`` elements of this dtype); returns it as an array."""
        L, two, _, _, H, D = kv.shape
        o = np.frombuffer(out, dtype=self.dtype).reshape(L, two, num_tokens, H, D) if not isinstance(
            out, np.ndarray) else out.view(self.dtype).reshape(L, two, num_tokens, H, D)
        _gather_into(lambda src, idx, dst: np.take(src, idx, axis=0, out=dst), kv, blocks, num_tokens, o)
        return o

    def scatter_tokens(self, kv: np.ndarray, blocks: Sequence[int], src: Any) -> None:
        """Write ``src`` ``[L, 2, n, H, D]`` (any kind) into the first ``n`` token slots of
        ``blocks`` (in order) of the pool array ``kv``."""
        def put(dst, idx, rows):
            dst[idx] = rows
        _scatter(put, kv, blocks, self.as_array(src).astype(kv.dtype, copy=False))

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
        """Also reads bfloat16 KV carried as its raw 16-bit patterns in an int16/uint16 numpy
        array (numpy has no bfloat16; :meth:`to_numpy` produces such arrays)."""
        torch = self._torch
        if self.dtype == torch.bfloat16 and isinstance(x, np.ndarray) and x.dtype in (np.int16, np.uint16):
            return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)
        return torch.as_tensor(x)

    def copy_into(self, dst: Any, src: Any) -> None:
        dst.copy_(self.as_array(src).to(dst.device, dst.dtype))

    def to_numpy(self, x: Any) -> np.ndarray:
        """Host numpy copy-or-view; bfloat16 comes out as its raw bits in an int16 array
        (payloads for L3 and the handoff; :meth:`as_array` reads them back exactly)."""
        x = x.contiguous().cpu()
        if x.dtype == self._torch.bfloat16:
            return x.view(self._torch.int16).numpy()
        return x.numpy()

    def gather_tokens_into(self, kv: Any, blocks: Sequence[int], num_tokens: int, out: Any) -> Any:
        """Write the first ``num_tokens`` tokens' KV of ``blocks`` into ``out`` (a contiguous
        tensor, or any writable buffer, of exactly ``[L, 2, num_tokens, H, D]`` elements of this
        dtype — e.g. a shared-memory staging area); returns it as a tensor. One gather per
        (layer, K/V) writes the destination directly: no intermediate copy."""
        torch = self._torch
        L, two, _, _, H, D = kv.shape
        if isinstance(out, torch.Tensor):
            o = out.view(L, two, num_tokens, H, D)
        else:
            o = torch.frombuffer(out, dtype=self.dtype).view(L, two, num_tokens, H, D)
        if o.device != kv.device:  # e.g. a CUDA pool into a host buffer: gather on device, one copy
            o.copy_(self.gather_tokens(kv, blocks, num_tokens))
            return o

        def take(src, idx, dst):
            torch.index_select(src, 0, torch.as_tensor(idx, dtype=torch.int64, device=src.device), out=dst)
        _gather_into(take, kv, blocks, num_tokens, o)
        return o

    def scatter_tokens(self, kv: Any, blocks: Sequence[int], src: Any) -> None:
        """Write ``src`` ``[L, 2, n, H, D]`` (any kind, device, dtype) into the first ``n``
        token slots of ``blocks`` (in order) of the pool tensor ``kv``: one ``index_copy_``
        per (layer, K/V) instead of a copy per block."""
        torch = self._torch
        s = self.as_array(src).to(kv.device, kv.dtype)

        def put(dst, idx, rows):
            dst.index_copy_(0, torch.as_tensor(idx, dtype=torch.int64, device=dst.device), rows)
        _scatter(put, kv, blocks, s)

    def gather_tokens(self, kv: Any, blocks: Sequence[int], num_tokens: int) -> Any:
        idx = self._torch.as_tensor(list(blocks), dtype=self._torch.int64, device=kv.device)
        sel = kv.index_select(2, idx)  # [L, 2, nb, bs, H, D]
        L, two, nb, bs, H, D = sel.shape
        return sel.reshape(L, two, nb * bs, H, D)[:, :, :num_tokens].contiguous()
