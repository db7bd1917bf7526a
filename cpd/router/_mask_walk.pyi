# Types of the optional C extension built from _mask_walk.c (see mask_table.py).
from typing import Any, Sequence

def walk(table: Any, salt: int, shift: int, keys: Sequence[int], group: int, /) -> dict[int, tuple[int, int]] | None: ...
