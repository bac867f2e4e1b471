"""Where a worker's LoRA adapters are, as plain Python (no torch): the host cache of adapters read from
disk (--max-cpu-loras of them, the least recently used evicted) and the device slots the step's product
reads (--max-loras of them). An adapter on a device slot is always in the host cache too (vLLM's LRU
worker manager keeps the same order): evicting it from the host frees its slot."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class HostCache:
    """At most `capacity` adapters by name, the least recently used first out."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"--max-cpu-loras {capacity}: at least 1")
        self.capacity = capacity
        self._items: OrderedDict[str, object] = OrderedDict()

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def __len__(self) -> int:
        return len(self._items)

    def names(self) -> list[str]:
        """Least recently used first."""
        return list(self._items)

    def get(self, name: str):
        """The adapter (now the most recently used), or None."""
        if name not in self._items:
            return None
        self._items.move_to_end(name)
        return self._items[name]

    def put(self, name: str, value, keep: Iterable[str] = ()) -> list[str]:
        """Adds (or replaces) an adapter as the most recently used; returns the names evicted to make
        room, least recently used first, never one of `keep` (the step's own adapters)."""
        self._items[name] = value
        self._items.move_to_end(name)
        keep = set(keep) | {name}
        evicted = []
        for old in list(self._items):
            if len(self._items) <= self.capacity:
                break
            if old not in keep:
                del self._items[old]
                evicted.append(old)
        return evicted

    def pop(self, name: str):
        return self._items.pop(name, None)


class DeviceSlots:
    """`count` slots of the stacked adapter weights, and which adapter each holds."""

    def __init__(self, count: int):
        self.count = count
        self._slot: OrderedDict[str, int] = OrderedDict()  # least recently used first

    def slot(self, name: str) -> int | None:
        return self._slot.get(name)

    def assign(self, wanted: Iterable[str]) -> tuple[dict[str, int], list[tuple[int, str]]]:
        """Slots for the step's adapters (at most `count`: the scheduler's --max-loras), and the (slot,
        adapter) writes that places them: a free slot first, else the least recently used one whose
        adapter is not wanted."""
        wanted = list(dict.fromkeys(wanted))
        if len(wanted) > self.count:
            raise ValueError(f"{len(wanted)} LoRA adapters in one step, above --max-loras {self.count}")
        for name in wanted:
            if name in self._slot:
                self._slot.move_to_end(name)
        writes = []
        free = sorted(set(range(self.count)) - set(self._slot.values()))
        for name in wanted:
            if name in self._slot:
                continue
            if free:
                slot = free.pop(0)
            else:
                victim = next(n for n in self._slot if n not in wanted)
                slot = self._slot.pop(victim)
            self._slot[name] = slot
            writes.append((slot, name))
        return {name: self._slot[name] for name in wanted}, writes

    def drop(self, name: str) -> int | None:
        """Frees the adapter's slot (its slot, or None)."""
        return self._slot.pop(name, None)
