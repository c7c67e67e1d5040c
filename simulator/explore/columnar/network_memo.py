"""A plain-dict memo in front of a search's NetworkCosts for one columnar call: a plan's numbers ask for the same
(kind, group, bytes, stage groups) hundreds of times, and NetworkCosts' own memo pays for its key (the stage's other
groups filtered out) and its bounded cache's bookkeeping on every ask. Each answer is NetworkCosts' own."""

from __future__ import annotations

from simulator.explore.assemble import Caches

ENTRIES_KEPT = 200_000          # answers held before the memo starts over (they are recomputed the same)


class _Memo:
    def __init__(self, network) -> None:
        self.network = network
        self.topology = network.topology
        self._seen: dict = {}

    def _remember(self, key, answer: float) -> float:
        if len(self._seen) >= ENTRIES_KEPT:
            self._seen.clear()
        self._seen[key] = answer
        return answer

    def collective_s(self, kind: str, group: tuple, size_bytes: float, together: tuple = ()) -> float:
        key = (kind, group, size_bytes, together)
        found = self._seen.get(key)
        return found if found is not None else self._remember(
            key, self.network.collective_s(kind, group, size_bytes, together))

    def send_s(self, src: int, dst: int, size_bytes: float, together: tuple = ()) -> float:
        key = ("send", src, dst, size_bytes, together)
        found = self._seen.get(key)
        return found if found is not None else self._remember(
            key, self.network.send_s(src, dst, size_bytes, together))


class SharedCaches:
    """`caches` (assemble.Caches) for assemble.numbers, with each NetworkCosts behind a _Memo."""

    def __init__(self, caches: Caches) -> None:
        self._caches = caches
        self._memos: dict[int, _Memo] = {}

    def __getattr__(self, name: str):
        return getattr(self._caches, name)

    def network(self, topology):
        found = self._caches.network(topology)
        if found is None:
            return None
        memo = self._memos.get(id(found))
        if memo is None or memo.network is not found:
            memo = self._memos[id(found)] = _Memo(found)
        return memo
