"""Block hash → worker bitmasks (one per tier) for the router's prefix index, looked up for a
whole prompt at once (issue 13 item 5).

A ``dict[int, int]`` lookup costs about three dependent cache misses (its index, its entry,
the key's int object), and a Python loop cannot overlap them: right after hashing a long
prompt (which evicts the caches) on a loaded machine that was ≈ 0.7 µs per block, 4 – 5 ms
for the ≈ 6 000 warm blocks of a 128K-token prompt. This table keeps the same mappings in one
numpy array of ``(key, L1 mask, L2 mask)`` rows with open addressing (linear probing): a
prompt's blocks are looked up by a few vectorised gathers, whose cache misses overlap, and
one lookup answers both tiers.

Rules (what :class:`MaskTable` guarantees; ``tests/unit/test_index_equivalence.py`` checks
them against plain dicts):

* It behaves as one ``dict[int, int]`` per tier mapping a key to a non-zero mask of *local*
  worker bits ``1 << 0 .. 1 << 62``: :meth:`add` / :meth:`remove` set / clear one bit of one
  tier for many keys, a key whose mask becomes 0 is gone from that tier, :meth:`get` /
  :meth:`lookup` answer 0 for absent keys.
* Keys in ``[0, 2**64)`` (every block hash) live in the array; any other int key (never
  produced by :mod:`cpd.kv.block_hash`) lives in a side dict, so the answers are those of a
  dict for every int.
* Slot states: both masks 0 = empty; L1 mask :data:`TOMB` and L2 mask 0 = deleted (the key
  stays); anything else = live (a key held in some tier). A key is inserted at the first free
  (empty or deleted) slot of its probe sequence, and a slot becomes empty again only by a
  rebuild. Hence a probe that meets an empty slot proves the key absent, and a live copy of a
  key always lies before any deleted slot still naming it (so meeting such a slot proves it
  absent too).
* Bounded memory: the array is rebuilt (live rows re-inserted) when live + deleted slots would
  exceed :data:`MAX_LOAD` (3/8) of it, to ``GROWTH × live`` (4 ×) slots rounded up to a power
  of two (≥ :data:`MIN_SLOTS`), and shrunk the same way when live keys fall below 1/16 of it.
  24 bytes per slot: 64 – 192 bytes per live key after a growth, at most 384 before a shrink
  (1 M hashes: 4 M slots, 96 MiB, in huge pages where the kernel allows); a rebuild holds the
  old and the new array at once (the bench's 1 M-entry index: 134 MiB resident, 286 MiB peak
  while it grew; the dicts it replaces: 122 / 155 MiB).
* The slot of a key is a multiplicative hash of it with a random odd 64-bit factor drawn per
  table, so chosen block hashes cannot pile up on one probe chain.
* Batches of at most :data:`SCALAR_MAX` keys are applied key by key in Python through a
  memoryview of the array (no per-call numpy overhead); larger ones are vectorised. Both
  paths give the same contents.
* :meth:`MaskTable.runs` (a prompt's leading runs, what the router's match needs) is one C
  call where the optional extension ``cpd/router/_mask_walk.c`` is built: a probe per block
  straight from the list of block hashes, stopping where no run continues. It returns None
  where the extension is missing or the keys are not a list/tuple of ints in ``[0, 2**64)``;
  the caller then walks with :meth:`lookup` (same answers, ``tests/unit/test_mask_walk.py``).

Not thread-safe: the owner (:class:`cpd.router.index.PrefixIndex`) serialises calls.
"""
from __future__ import annotations

import secrets
from typing import Callable, Iterable, Sequence

import numpy as np
import numpy.typing as npt

U64 = npt.NDArray[np.uint64]

M64 = (1 << 64) - 1
TOMB = 1 << 63  # the mask of a deleted slot
LOW = TOMB - 1  # the worker bits of a mask
PLANE_BITS = 63  # worker bits per table
TIERS = 2  # mask columns: L1, L2
MIN_SLOTS = 1024
SCALAR_MAX = 48  # batches up to this many keys are applied key by key in Python
STRAGGLERS = 16  # keys left for which a vectorised lookup or update finishes one by one
MAX_LOAD = 3 / 8  # rebuild when live + deleted slots would exceed this share of the array
GROWTH = 4  # a rebuilt array has the smallest power of two >= GROWTH x live keys slots
_TOMB = np.uint64(TOMB)
_LOW = np.uint64(LOW)
_ZERO = np.uint64(0)


def _load_walk() -> Callable[[U64, int, int, Sequence[int], int], dict[int, tuple[int, int]] | None] | None:
    """The C extension's ``walk`` (``cpd/router/_mask_walk.c``), or None where it is not built."""
    try:
        from cpd.router import _mask_walk
    except ImportError:
        return None
    return _mask_walk.walk


_walk_native = _load_walk()


def as_u64(keys: Sequence[int] | np.ndarray) -> U64 | None:
    """``keys`` as a uint64 array, or None if one of them is not an int in ``[0, 2**64)``."""
    if isinstance(keys, np.ndarray):
        if keys.dtype == np.uint64:
            return keys
        keys = keys.tolist()
    try:
        return np.asarray(keys, dtype=np.uint64)
    except (OverflowError, TypeError, ValueError):
        return None


class MaskTable:
    """int key → one mask of local worker bits per tier (see the module docstring)."""

    tiers = TIERS

    def __init__(self) -> None:
        self._w = 1 + TIERS  # row width: key, masks
        self._salt = secrets.randbits(64) | 1
        self._salt_np = np.uint64(self._salt)
        self._odd: dict[int, list[int]] = {}  # keys outside [0, 2**64) -> masks
        self.num_pairs = [0] * TIERS  # (key, bit) pairs held per tier
        self._alloc(MIN_SLOTS)

    def _alloc(self, slots: int) -> None:
        # numpy allocates (and, for large arrays, asks the kernel for huge pages: fewer TLB misses
        # in the random gathers); the key-by-key path reads and writes it through a memoryview
        self._tab = np.zeros((slots, self._w), np.uint64)
        self._buf = self._tab.data.cast("B").cast("Q")
        self._slots = slots
        self._cmask = slots - 1
        self._shift = 64 - (slots.bit_length() - 1)
        self._shift_np = np.uint64(self._shift)
        self._live = 0  # live slots
        self._used = 0  # slots not empty (live + deleted)

    # --- queries ---------------------------------------------------------------------
    def __len__(self) -> int:
        """Keys held (in any tier)."""
        return self._live + len(self._odd)

    def num_slots(self) -> int:
        return self._slots

    def get(self, key: int) -> tuple[int, ...]:
        """Masks of ``key`` per tier (0: absent)."""
        k = int(key)
        if not 0 <= k <= M64:
            return tuple(self._odd.get(k, (0,) * self.tiers))
        s = self._probe(k)[0]
        return tuple(self._buf[self._w * s + 1 + t] for t in range(self.tiers)) if s >= 0 else (0,) * self.tiers

    def runs(self, keys: Sequence[int], group: int) -> dict[int, tuple[int, int]] | None:
        """For each local worker bit of ``group``: (end of its run of consecutive keys from
        ``keys[0]`` held in L1, end of the run continuing it in L2 from there), in C; None where
        the extension is not built or ``keys`` is not a list/tuple of ints in ``[0, 2**64)``
        (then walk with :meth:`lookup`). Keys outside that range never live in the array, so
        the side dict plays no part here."""
        if _walk_native is None:
            return None
        return _walk_native(self._tab, self._salt, self._shift, keys, group)

    def lookup(self, keys: U64) -> U64:
        """Masks of ``keys``, shape ``(len(keys), tiers)`` (0: absent), vectorised: each round
        reads the next slot of every unresolved key's probe sequence (one gather of one row);
        once few keys are left they finish one by one. Each numpy call costs microseconds
        (tens right after hashing a long prompt has evicted the caches), so a round is kept
        to a few calls:

        * a slot holding the key resolves it: its masks if live; if deleted, the key is absent
          (a key is inserted at the first free slot of its sequence, so a live copy of it
          always lies before any deleted slot still naming it);
        * an empty slot resolves it as absent (a key never lies after an empty slot of its
          sequence)."""
        n = len(keys)
        if not self._live or not n:
            return np.zeros((n, TIERS), np.uint64)
        tab, cm = self._tab, self._cmask
        pos = self._home(keys)
        rows = tab.take(pos, axis=0)
        eq = rows[:, 0] == keys
        out = rows[:, 1:] & _LOW
        out[~eq] = _ZERO
        more = (((rows[:, 1] | rows[:, 2]) != _ZERO) & ~eq).nonzero()[0]
        left = more  # indices into keys
        while left.size > STRAGGLERS:
            pos = (pos[more] + 1) & cm
            rows = tab.take(pos, axis=0)
            eq = rows[:, 0] == keys[left]
            hit = eq.nonzero()[0]
            out[left[hit]] = rows[hit, 1:] & _LOW
            more = (((rows[:, 1] | rows[:, 2]) != _ZERO) & ~eq).nonzero()[0]
            left = left[more]
        for i in left.tolist():
            out[i] = self.get(int(keys[i]))
        return out

    def items(self, tier: int) -> list[tuple[int, int]]:
        """All (key, mask) pairs of one tier (tests and debugging)."""
        col = self._tab[:, 1 + tier]
        sel = (col & _LOW) != _ZERO
        return [(int(k), int(m)) for k, m in zip(self._tab[sel, 0].tolist(), col[sel].tolist())] + [
            (k, ms[tier]) for k, ms in self._odd.items() if ms[tier]]

    # --- updates ---------------------------------------------------------------------
    def add(self, tier: int, bit: int, keys: Iterable[int]) -> None:
        """Set local ``bit`` in the ``tier`` mask of every key of ``keys``."""
        ks = keys if isinstance(keys, (list, tuple, np.ndarray)) else list(keys)
        arr = None if len(ks) <= SCALAR_MAX else as_u64(ks)
        if arr is None:
            add_one = self._add_one
            for k in ks:
                add_one(tier, bit, int(k))
        else:
            self._add_many(tier, bit, np.unique(arr))

    def remove(self, tier: int, bit: int, keys: Iterable[int]) -> None:
        """Clear local ``bit`` in the ``tier`` mask of every key of ``keys`` (absent: nothing)."""
        ks = keys if isinstance(keys, (list, tuple, np.ndarray)) else list(keys)
        if not self._live and not self._odd:
            return
        arr = None if len(ks) <= SCALAR_MAX else as_u64(ks)
        if arr is None:
            for k in ks:
                self._remove_one(tier, bit, int(k))
        else:
            self._remove_many(tier, bit, arr)
        self._maybe_shrink()

    def clear_bit(self, bit: int) -> None:
        """Clear local ``bit`` in every tier everywhere."""
        for k, ms in list(self._odd.items()):
            for t in range(self.tiers):
                if ms[t] & bit:
                    self._odd_set(k, t, ms[t] ^ bit)
        b = np.uint64(bit)
        had_any = np.zeros(self._slots, bool)
        for t in range(self.tiers):
            col = self._tab[:, 1 + t]  # a view; deleted slots never hold bit < 2**63
            had = (col & b) != _ZERO
            n = int(np.count_nonzero(had))
            if n:
                col[had] &= ~b
                had_any |= had
                self.num_pairs[t] -= n
        gone = (had_any & (self._tab[:, 1] == _ZERO) & (self._tab[:, 2] == _ZERO)).nonzero()[0]
        self._tab[gone, 1] = _TOMB
        self._live -= int(gone.size)
        self._maybe_shrink()

    # --- internals: one key ----------------------------------------------------------
    def _probe(self, k: int) -> tuple[int, int]:
        """(slot of live ``k`` or -1, first free slot of its probe sequence)."""
        buf, cm, w = self._buf, self._cmask, self._w
        s = ((k * self._salt) & M64) >> self._shift
        free = -1
        while True:
            r = w * s
            m0 = buf[r + 1]
            rest = buf[r + 2]
            if m0 == TOMB and not rest:
                if free < 0:
                    free = s
            elif not m0 and not rest:
                return -1, (s if free < 0 else free)
            elif buf[r] == k:
                return s, free
            s = (s + 1) & cm

    def _add_one(self, tier: int, bit: int, k: int) -> None:
        if not 0 <= k <= M64:
            ms = self._odd.setdefault(k, [0] * self.tiers)
            if not ms[tier] & bit:
                ms[tier] |= bit
                self.num_pairs[tier] += 1
            return
        s, free = self._probe(k)
        if s >= 0:
            i = self._w * s + 1 + tier
            if not self._buf[i] & bit:
                self._buf[i] |= bit
                self.num_pairs[tier] += 1
            return
        if self._used + 1 > MAX_LOAD * self._slots:
            self._rebuild(self._live + 1)
            s, free = self._probe(k)
        buf, r = self._buf, self._w * free
        if buf[r + 1] == 0:
            self._used += 1
        buf[r] = k
        buf[r + 1] = 0 if tier else bit
        buf[r + 2] = bit if tier else 0
        self._live += 1
        self.num_pairs[tier] += 1

    def _remove_one(self, tier: int, bit: int, k: int) -> None:
        if not 0 <= k <= M64:
            ms = self._odd.get(k)
            if ms and ms[tier] & bit:
                self._odd_set(k, tier, ms[tier] ^ bit)
            return
        s = self._probe(k)[0]
        if s < 0:
            return
        r = self._w * s
        m = self._buf[r + 1 + tier]
        if m & bit:
            self._buf[r + 1 + tier] = m ^ bit
            self.num_pairs[tier] -= 1
            if not self._buf[r + 1] and not self._buf[r + 2]:
                self._buf[r + 1] = TOMB
                self._live -= 1

    def _odd_set(self, k: int, tier: int, m: int) -> None:
        self.num_pairs[tier] -= 1
        self._odd[k][tier] = m
        if not any(self._odd[k]):
            del self._odd[k]

    # --- internals: vectorised -------------------------------------------------------
    def _home(self, keys: U64) -> npt.NDArray[np.intp]:
        return ((keys * self._salt_np) >> self._shift_np).astype(np.intp)  # wraps mod 2**64

    def _find(self, keys: U64) -> npt.NDArray[np.intp]:
        """Slot of each live key or -1, probed as in :meth:`lookup`."""
        n = len(keys)
        slots = np.full(n, -1, np.intp)
        idx, pos, ks = np.arange(n), self._home(keys), keys
        tab, cm = self._tab, self._cmask
        while idx.size > STRAGGLERS:
            rows = tab.take(pos, axis=0)
            live = ((rows[:, 1] & _LOW) | rows[:, 2]) != _ZERO
            hit = (rows[:, 0] == ks) & live
            slots[idx[hit]] = pos[hit]
            more = ~hit & (live | (rows[:, 1] != _ZERO))
            idx, pos, ks = idx[more], (pos[more] + 1) & cm, ks[more]
        for i, k in zip(idx.tolist(), ks.tolist()):
            slots[i] = self._probe(k)[0]
        return slots

    def _add_many(self, tier: int, bit: int, keys: U64) -> None:
        """``keys`` distinct, in ``[0, 2**64)``."""
        slots = self._find(keys)
        hit = slots >= 0
        b = np.uint64(bit)
        col = self._tab[:, 1 + tier]
        hs = slots[hit]
        upd = hs[(col[hs] & b) == _ZERO]
        col[upd] |= b
        self.num_pairs[tier] += int(upd.size)
        new = keys[~hit]
        if new.size:
            if self._used + new.size > MAX_LOAD * self._slots:
                self._rebuild(self._live + new.size)
            rows = np.zeros((new.size, self._w), np.uint64)
            rows[:, 0] = new
            rows[:, 1 + tier] = b
            self._insert(rows)
            self.num_pairs[tier] += int(new.size)

    def _remove_many(self, tier: int, bit: int, keys: U64) -> None:
        slots = self._find(keys)
        b = np.uint64(bit)
        col = self._tab[:, 1 + tier]
        s = slots[slots >= 0]
        s = np.unique(s[(col[s] & b) != _ZERO])  # a key given twice counts once
        if not s.size:
            return
        col[s] &= ~b
        self.num_pairs[tier] -= int(s.size)
        gone = s[(self._tab[s, 1] == _ZERO) & (self._tab[s, 2] == _ZERO)]
        self._tab[gone, 1] = _TOMB
        self._live -= int(gone.size)

    def _insert(self, rows: U64) -> None:
        """Put rows of absent, distinct keys into free slots (capacity reserved), each at the
        first free slot of its probe sequence. In a round every key still unplaced writes
        itself into the slot it reached if that is free; the key that reads back there won it
        (keys are distinct), the others probe on. The last few are placed one by one."""
        tab, cm = self._tab, self._cmask
        idx, pos = np.arange(len(rows)), self._home(rows[:, 0])
        self._live += len(rows)
        while idx.size > STRAGGLERS:
            m = tab.take(pos, axis=0)
            free = (((m[:, 1] == _ZERO) | (m[:, 1] == _TOMB)) & (m[:, 2] == _ZERO)).nonzero()[0]
            if free.size:
                fp, fk = pos[free], rows[idx[free], 0]
                tab[fp, 0] = fk
                win = free[tab[fp, 0] == fk]
                self._used += int(np.count_nonzero(m[win, 1] == _ZERO))
                tab[pos[win]] = rows[idx[win]]
                keep = np.ones(idx.size, bool)
                keep[win] = False
                idx, pos = idx[keep], pos[keep]
            pos = (pos + 1) & cm
        buf, w = self._buf, self._w
        for row in rows[idx].tolist():
            free_slot = self._probe(row[0])[1]
            r = w * free_slot
            if buf[r + 1] == 0:
                self._used += 1
            buf[r], buf[r + 1], buf[r + 2] = row

    def _rebuild(self, need: int) -> None:
        """Re-insert the live rows into a fresh array sized for ``need`` live keys."""
        live = self._tab[((self._tab[:, 1] & _LOW) | self._tab[:, 2]) != _ZERO].copy()
        slots = MIN_SLOTS
        while slots < GROWTH * need:
            slots *= 2
        self._alloc(slots)
        if len(live):
            self._insert(live)

    def _maybe_shrink(self) -> None:
        if self._slots > MIN_SLOTS and 4 * GROWTH * self._live < self._slots:
            self._rebuild(self._live)
