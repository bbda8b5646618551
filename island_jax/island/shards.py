"""What one process of an island holds of the global parameters (`HostLeaf`), and which chunks of the outer
loop it owns (`Ownership`).

The chunk plan (`codec.chunk_plan`) is one plan for every island and the coordinator, whatever their layouts.
Over an island's mesh a leaf is a set of shards (`LeafLayout`), each a few runs of consecutive elements
(`mesh.shard_runs`), so a chunk lies within one process's runs except at a shard's edge. Every chunk has one
owner, a process that holds the most of its elements (ties dealt out by bytes, the rule of `codec.deal`),
which encodes the chunk's pseudo-gradient, sends it and fetches its update. Over the island's interconnect
(`distributed.exchange_rows`, a collective) travel only the elements at shard edges that an owner lacks, and
an update's bytes to the other processes that hold elements of its chunk. Each process applies the update to
the elements it holds with the coordinator's arithmetic (`codec.decode_and_apply`), so every island keeps
bit-identical global parameters (docs/island.md, "The outer loop, shard by shard").
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Callable, Sequence

import jax
import numpy as np

from island_jax import distributed
from island_jax.mesh import index_key, shard_runs
from island_jax.outer import codec

Key = tuple  # a shard's box: ((start, stop) per dimension)


class LeafLayout:
    """Where one parameter leaf's elements are over an island's processes.

    Args:
      shape, dtype: the leaf's.
      sharding: its sharding on the island's mesh (every device of every process of the island).
      process_of: the process a device belongs to (default: its `process_index`); with `process`, this
        process's index (default: `jax.process_index()`). A test may pretend one process's devices are several
        processes' to work out what each would hold.

    Attributes:
      keys: the distinct shards (boxes, `mesh.index_key`), in the order of the sharding's devices.
      holders: per shard, the processes holding it, ascending; the first reads it for the checksum and sends
        its elements to owners that lack them.
      mine: the shards this process holds (indices into `keys`).
      single_process: every device of the sharding is this process's.
    """

    def __init__(self, shape: Sequence[int], dtype, sharding: jax.sharding.Sharding,
                 process_of: Callable[[jax.Device], int] | None = None, process: int | None = None):
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self.size = math.prod(self.shape)
        self.sharding = sharding
        self.process = jax.process_index() if process is None else process
        process_of = process_of or (lambda device: device.process_index)
        ids: dict[Key, int] = {}
        holders: list[set] = []
        for device, index in sharding.devices_indices_map(self.shape).items():
            key = index_key(index, self.shape)
            if key not in ids:
                ids[key] = len(ids)
                holders.append(set())
            holders[ids[key]].add(process_of(device))
        self._ids = ids
        self.keys = list(ids)
        self.holders = [tuple(sorted(h)) for h in holders]
        self.mine = [k for k, h in enumerate(self.holders) if self.process in h]
        self.single_process = all(h == (self.process,) for h in self.holders)
        runs = sorted((start, n, k, offset) for k in range(len(self.keys))
                      for start, n, offset in shard_runs(self.shape, self.box(k)) if n)
        self._starts = [r[0] for r in runs]
        self._runs = runs

    def key_of(self, index: tuple) -> int:
        """The shard number of a device's `index` (slices)."""
        return self._ids[index_key(index, self.shape)]

    def box(self, k: int) -> tuple[slice, ...]:
        """Shard `k`'s box as an index (one slice per dimension)."""
        return tuple(slice(lo, hi) for lo, hi in self.keys[k])

    def runs_of(self, k: int) -> list[tuple[int, int, int]]:
        """Shard `k`'s runs: (first flat element of the leaf, elements, first element of the shard) each."""
        return [(start, n, offset) for start, n, shard, offset in self._runs if shard == k]

    def segments(self, start: int, stop: int) -> list[tuple[int, int, int, int]]:
        """Elements [start, stop) of the flat leaf, cut at the shards' runs: (first, end, shard, the first's place
        in the shard's C-order elements) each, in order. The runs of the distinct shards partition the leaf."""
        out = []
        i = max(bisect.bisect_right(self._starts, start) - 1, 0)
        while i < len(self._runs) and self._runs[i][0] < stop:
            first, n, k, offset = self._runs[i]
            lo, hi = max(first, start), min(first + n, stop)
            if lo < hi:
                out.append((lo, hi, k, offset + lo - first))
            i += 1
        return out


def view_chunks(plan: list[codec.Chunk], layouts: Sequence[LeafLayout]) -> list[codec.Chunk]:
    """The chunks of a float32 "none" payload of every leaf (`plan`: the coordinator's view plan, leaves in order,
    4 bytes an element) that hold elements of this process's shards (`LeafLayout.mine`)."""
    starts = np.cumsum([0] + [layout.size for layout in layouts])  # each leaf's first element in the payload
    mine = [set(layout.mine) for layout in layouts]
    out = []
    for chunk in plan:
        first, end = chunk.offset // 4, (chunk.offset + chunk.nbytes) // 4
        for i in range(int(np.searchsorted(starts, first, side="right")) - 1, len(layouts)):
            if starts[i] >= end:
                break
            layout = layouts[i]
            lo, hi = max(first, starts[i]) - starts[i], min(end, starts[i + 1]) - starts[i]
            if any(k in mine[i] for _, _, k, _ in layout.segments(int(lo), int(hi))):
                out.append(chunk)
                break
    return out


class HostLeaf:
    """One parameter leaf's host copy: the distinct shards this process holds (NumPy, C order, the leaf's dtype).

    It stands for the leaf where the checksum (`model.init.checksum`) and the island's placement need it;
    `np.asarray` of it is refused, since no process holds the leaf whole unless its layout says so.

    Attributes:
      layout: the leaf's `LeafLayout`.
      shards: {shard number: its array}, for `layout.mine`.
    """

    def __init__(self, layout: LeafLayout, shards: dict[int, np.ndarray]):
        self.layout, self.shards = layout, shards

    shape = property(lambda self: self.layout.shape)
    dtype = property(lambda self: self.layout.dtype)
    size = property(lambda self: self.layout.size)
    ndim = property(lambda self: len(self.layout.shape))
    is_fully_addressable = property(lambda self: self.layout.single_process)
    nbytes = property(lambda self: sum(a.nbytes for a in self.shards.values()))

    @classmethod
    def of(cls, layout: LeafLayout, x) -> "HostLeaf":
        """This process's shards of `x`, copied: a whole NumPy array (or anything `np.asarray` takes), or a
        `jax.Array` with `layout.sharding` (read shard by shard, never whole)."""
        if isinstance(x, jax.Array):
            shards = {}
            for shard in x.addressable_shards:
                k = layout.key_of(shard.index)
                if k not in shards:
                    shards[k] = np.array(shard.data, layout.dtype, copy=True)
            return cls(layout, shards)
        x = np.asarray(x)
        return cls(layout, {k: np.array(x[layout.box(k)], layout.dtype, copy=True) for k in layout.mine})

    def __array__(self, *args, **kwargs):
        raise TypeError(f"a parameter leaf of shape {self.shape} is held as this process's shards; read them "
                        "(`shards`) or place it (`place`)")

    def flat(self, k: int) -> np.ndarray:
        """Shard `k`'s elements, C order, as a 1-D view."""
        return self.shards[k].reshape(-1)

    def copy(self) -> "HostLeaf":
        return HostLeaf(self.layout, {k: a.copy() for k, a in self.shards.items()})

    def place(self) -> jax.Array:
        """The leaf on the island's devices, each device given its shard (no communication)."""
        layout = self.layout
        return jax.make_array_from_callback(layout.shape, layout.sharding, lambda index: self.shards[layout.key_of(index)])

    def checksum_runs(self):
        """(first flat element, uint8 bytes) of each run of the shards this process reads for the checksum (those
        whose lowest holder it is), so that every element is read once over the island."""
        layout = self.layout
        for k in layout.mine:
            if layout.holders[k][0] != layout.process:
                continue
            flat = np.ascontiguousarray(self.shards[k]).reshape(-1).view(np.uint8)
            itemsize = layout.dtype.itemsize
            for start, n, offset in layout.runs_of(k) or shard_runs(layout.shape, layout.box(k)):  # empty: one run
                yield start, flat[offset * itemsize : (offset + n) * itemsize]


@dataclasses.dataclass(frozen=True)
class _Segment:
    """Elements [lo, hi) of a piece's leaf (the piece of chunk `chunk`), in shard `shard` from its element `offset`."""

    chunk: int
    piece: codec.Piece
    lo: int
    hi: int
    shard: int
    offset: int


class Ownership:
    """Which process owns each chunk of one fragment's plan, and what travels over the island's interconnect.

    Every process of the island derives the same `Ownership` from the plan and the layouts.

    Args:
      plan: the fragment's `codec.Chunk`s (its pieces' `leaf` index `layouts`).
      layouts: the fragment's leaves' `LeafLayout`s, in the plan's leaf order.
      processes: the island's process count.
      update_plan: the update's plan (`codec.chunk_plan` in the update's codec, the same chunks element for element);
        default `plan`.

    Attributes:
      owners: per chunk of the plan, its owner.
      shares: per process, the chunks it owns, in plan order.
      share: this process's chunks.
      residual_elements: per process, the elements of the pieces it owns (its error-feedback residual's size).
      values_sent: per process, the pseudo-gradient elements it passes on to owners that lack them, per exchange
        (float32, 4 bytes each), over the interconnect.
      update_bytes_sent: per process, the update bytes it passes on to the other holders of its chunks, per
        exchange, over the interconnect.
    """

    def __init__(self, plan: list[codec.Chunk], layouts: Sequence[LeafLayout], processes: int,
                 update_plan: list[codec.Chunk] | None = None):
        self.plan, self.layouts, self.processes = plan, list(layouts), processes
        self.update_plan = plan if update_plan is None else update_plan
        self.process = self.layouts[0].process if processes > 1 and self.layouts else 0
        self.segments: list[list[_Segment]] = []
        self.owners: list[int] = []
        self.holders: list[set[int]] = []  # per chunk: every process holding any of its elements
        loads = [0] * processes
        for chunk in plan:
            segments = [_Segment(chunk.index, piece, lo, hi, k, offset) for piece in chunk.pieces
                        for lo, hi, k, offset in self.layouts[piece.leaf].segments(piece.start, piece.stop)]
            held = [0] * processes
            for s in segments:
                for p in self.layouts[s.piece.leaf].holders[s.shard]:
                    held[p] += s.hi - s.lo
            most = max(held)
            owner = min((p for p in range(processes) if held[p] == most), key=lambda p: (loads[p], p))
            loads[owner] += chunk.nbytes
            self.segments.append(segments)
            self.owners.append(owner)
            self.holders.append({p for p in range(processes) if held[p]} | {owner})
        self.shares = [[c for c in plan if self.owners[c.index] == p] for p in range(processes)]
        self.share = self.shares[self.process]
        self.residual_elements = [sum(piece.stop - piece.start for c in share for piece in c.pieces)
                                  for share in self.shares]
        # Elements owners lack, in plan order: who sends each (the lowest holder), and where it sits in its rows.
        self._sent_values: list[list[_Segment]] = [[] for _ in range(processes)]
        for chunk in plan:
            owner = self.owners[chunk.index]
            for s in self.segments[chunk.index]:
                holders = self.layouts[s.piece.leaf].holders[s.shard]
                if owner not in holders:
                    self._sent_values[holders[0]].append(s)
        self.values_sent = [sum(s.hi - s.lo for s in sent) for sent in self._sent_values]
        # Update chunks that other processes need, in plan order, by owner.
        self._sent_updates: list[list[codec.Chunk]] = [
            [self.update_plan[c.index] for c in self.shares[p] if self.holders[c.index] - {p}] for p in range(processes)
        ]
        self.update_bytes_sent = [sum(c.nbytes for c in sent) for sent in self._sent_updates]

    # -- the pseudo-gradient, to the owners --------------------------------------------------------------

    def owner_values(self, local: Callable[[int, int], np.ndarray]) -> "OwnedValues":
        """The values of this process's chunks, for the encoder: from its own shards, and from the other processes
        for the elements it lacks (a collective over the island when any are lacking: every process calls it at
        the same point).

        Args:
          local: (leaf, shard) -> that shard's values of this process, float32, 1-D in C order.
        """
        mine = self._sent_values[self.process]
        out = np.empty(self.values_sent[self.process], np.float32)
        at = 0
        for s in mine:
            out[at : at + s.hi - s.lo] = local(s.piece.leaf, s.shard)[s.offset : s.offset + s.hi - s.lo]
            at += s.hi - s.lo
        rows = distributed.exchange_rows(out, self.values_sent) if max(self.values_sent, default=0) else None
        return OwnedValues(self, local, rows)

    # -- the update, from the owners ---------------------------------------------------------------------

    def update_sources(self, payload) -> dict[int, tuple[memoryview, int]]:
        """Where this process reads each update chunk it needs: {chunk: (buffer, the chunk's offset in it)}. Its own
        chunks are in `payload` at their offsets (what the transport fetched); the others' come from their owners
        (a collective over the island when any chunk has holders besides its owner)."""
        buf = memoryview(payload)
        out = {c.index: (buf, 0) for c in self.share}
        sizes = self.update_bytes_sent
        if not max(sizes, default=0):
            return out
        mine = np.empty(sizes[self.process], np.uint8)
        at = 0
        for c in self._sent_updates[self.process]:
            mine[at : at + c.nbytes] = np.frombuffer(buf, np.uint8, c.nbytes, c.offset)
            at += c.nbytes
        rows = distributed.exchange_rows(mine, sizes)
        for p, sent in enumerate(self._sent_updates):
            at = 0
            for c in sent:
                if p != self.process and self.process in self.holders[c.index]:
                    out[c.index] = (memoryview(rows[p]), c.offset - at)
                at += c.nbytes
        return out

    def apply(self, old: Sequence[HostLeaf], sources: dict[int, tuple[memoryview, int]], update_codec: codec.Codec,
              add: bool = True) -> list[HostLeaf]:
        """The fragment's new host leaves: `old` (this process's shards) plus the decoded update, in float32 and cast
        back (the arithmetic of `codec.decode_and_apply`), or replaced by the decoded values (`add=False`, a view).
        Reads only `sources`' chunks (`update_sources`); `old` is unchanged.

        Raises:
          CodecError: a chunk this process holds elements of is missing from `sources`.
        """
        new = [leaf.copy() for leaf in old]
        for chunk in self.update_plan:
            segments = [s for s in self.segments[chunk.index] if s.shard in old[s.piece.leaf].shards]
            if not segments:
                continue
            if chunk.index not in sources:
                raise codec.CodecError(f"the update's chunk {chunk.index} did not reach process {self.process}")
            buf, shift = sources[chunk.index]
            piece, decoded = None, None
            twins = {(p.leaf, p.start): p for p in chunk.pieces}  # the update's piece of each piece
            for s in segments:  # in piece order: each piece decoded once, and only it held at a time
                if s.piece is not piece:
                    piece, twin = s.piece, twins[(s.piece.leaf, s.piece.start)]
                    decoded = codec.decode_piece(buf, dataclasses.replace(twin, offset=twin.offset - shift),
                                                 update_codec)
                values = decoded[s.lo - piece.start : s.hi - piece.start]
                target = new[s.piece.leaf].flat(s.shard)[s.offset : s.offset + s.hi - s.lo]
                if add:
                    target[:] = (target.astype(np.float32) + values).astype(target.dtype, copy=False)
                else:
                    target[:] = values.astype(target.dtype, copy=False)
        return new


class OwnedValues:
    """The pseudo-gradient of the chunks one process owns, read piece by piece by the encoder
    (`codec.ChunkEncoder`'s `read`): views of the process's own shards where a piece lies in one of them."""

    def __init__(self, ownership: Ownership, local: Callable[[int, int], np.ndarray], rows):
        self.ownership, self.local = ownership, local
        self._remote: dict[tuple[int, int], tuple[int, int]] = {}  # (leaf, first element) -> (sender, row position)
        at = [0] * ownership.processes
        for p, sent in enumerate(ownership._sent_values):
            for s in sent:
                if ownership.owners[s.chunk] == ownership.process:
                    self._remote[(s.piece.leaf, s.lo)] = (p, at[p])
                at[p] += s.hi - s.lo
        self._rows = rows
        self._segments: dict[tuple[int, int], list[_Segment]] = {}
        for c in ownership.share:
            for s in ownership.segments[c.index]:
                self._segments.setdefault((s.piece.leaf, s.piece.start), []).append(s)

    def read(self, piece: codec.Piece) -> np.ndarray:
        """float32 [piece.stop - piece.start]: the piece's values (a view when one shard of this process holds it)."""
        segments = self._segments[(piece.leaf, piece.start)]
        held = self.ownership.layouts[piece.leaf].mine
        if len(segments) == 1 and segments[0].shard in held:
            s = segments[0]
            return self.local(piece.leaf, s.shard)[s.offset : s.offset + s.hi - s.lo]
        out = np.empty(piece.stop - piece.start, np.float32)
        for s in segments:
            target = out[s.lo - piece.start : s.hi - piece.start]
            if s.shard in held:
                target[:] = self.local(piece.leaf, s.shard)[s.offset : s.offset + s.hi - s.lo]
            else:
                p, at = self._remote[(piece.leaf, s.lo)]
                target[:] = self._rows[p][at : at + s.hi - s.lo]
        return out
