"""Links whose bandwidth is shared equally among concurrent flows (processor sharing)."""
from __future__ import annotations


class Link:
    """A link of ``bytes_per_s`` effective bandwidth, shared equally by its active flows.

    A flow of ``b`` bytes that starts at ``t`` finishes when its share of the bandwidth
    has carried ``b`` bytes, then a fixed ``latency_s`` is added. Completion events are
    scheduled through the owning simulator (``sim.at``) with a version stamp, so that a
    change in the number of flows invalidates the stale event.
    """

    __slots__ = ("name", "bw", "latency", "flows", "t_last", "version", "bytes_total", "sim", "_fid")

    def __init__(self, sim, name: str, bytes_per_s: float, latency_s: float):
        self.sim, self.name, self.bw, self.latency = sim, name, bytes_per_s, latency_s
        self.flows: dict[int, list] = {}  # fid -> [remaining_bytes, callback, args]
        self.t_last = 0.0
        self.version = 0
        self.bytes_total = 0.0
        self._fid = 0

    def _advance(self, now: float) -> None:
        if self.flows and now > self.t_last:
            share = (now - self.t_last) * self.bw / len(self.flows)
            for f in self.flows.values():
                f[0] -= share
        self.t_last = now

    def _reschedule(self, now: float) -> None:
        self.version += 1
        if self.flows:
            rem = min(f[0] for f in self.flows.values())
            self.sim.at(now + max(0.0, rem) * len(self.flows) / self.bw, self._on_done, self.version)

    def start(self, now: float, nbytes: float, cb, *args) -> None:
        """Start a flow; ``cb(now, *args)`` runs when it is done (after the latency)."""
        self.bytes_total += nbytes
        if nbytes <= 0:
            self.sim.at(now + self.latency, cb, *args)
            return
        self._advance(now)
        self._fid += 1
        self.flows[self._fid] = [float(nbytes), cb, args]
        self._reschedule(now)

    def _on_done(self, now: float, version: int) -> None:
        if version != self.version:
            return
        self._advance(now)
        eps = 1e-6 * self.bw * 1e-6 + 1.0  # bytes: float slack
        done = [fid for fid, f in self.flows.items() if f[0] <= eps]
        for fid in done:
            _, cb, args = self.flows.pop(fid)
            self.sim.at(now + self.latency, cb, *args)
        self._reschedule(now)
