"""A least-recently-used cache bounded by entries or by a weight (actions, graph nodes), for the estimate's memos."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable


class Lru:
    """A dict-like memo that drops its least recently used entries past `max_weight` (each entry weighs
    `weight(value)`, 1 by default). Every value is recomputable from its key, so dropping one only costs time.

    The newest entry is kept even when it alone weighs more than `max_weight`.
    """

    def __init__(self, max_weight: float, weight: Callable[[object], float] | None = None):
        if max_weight < 1:
            raise ValueError(f"Lru: max_weight = {max_weight!r}: must be >= 1")
        self.max_weight = max_weight
        self._weigh = weight
        self._items: OrderedDict[Hashable, tuple[object, float]] = OrderedDict()
        self.weight = 0.0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def get(self, key: Hashable, default=None):
        found = self._items.get(key)
        if found is None:
            return default
        self._items.move_to_end(key)
        return found[0]

    def __getitem__(self, key: Hashable):
        value, _ = self._items[key]
        self._items.move_to_end(key)
        return value

    def __setitem__(self, key: Hashable, value) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self.weight -= old[1]
        weight = float(self._weigh(value)) if self._weigh is not None else 1.0
        self._items[key] = (value, weight)
        self.weight += weight
        while self.weight > self.max_weight and len(self._items) > 1:
            _, (_, dropped) = self._items.popitem(last=False)
            self.weight -= dropped

    def setdefault(self, key: Hashable, default):
        found = self._items.get(key)
        if found is not None:
            self._items.move_to_end(key)
            return found[0]
        self[key] = default
        return default
