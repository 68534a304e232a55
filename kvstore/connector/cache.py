"""One KV cache group of a vLLM worker, as the connector reads and writes it.

A store object is one group's blocks for one chunk: every layer's bytes of those blocks,
layer-major. `GroupCache` gathers such an object out of the paged cache (save) and
scatters one back (load).

On CUDA the copies are pdserve.kernels' single-launch Triton gather/scatter, and the
stream order is explicit, because the save and load run beside the engine's forward:
- a gather runs on the caller's current stream (the engine's, inside `wait_for_save`),
  after the step's KV writes, and lands in pinned host memory before it returns, so a
  later step that reuses the blocks cannot change what is saved;
- a scatter runs on the group's own load stream, after a fence the connector records
  on the engine's stream in `start_load_kv` (the blocks may have been another request's
  a moment ago), and returns only once the copy is complete: the load thread reports the
  request received after that, never before (and only then gives the payloads' store
  leases back: a payload in the store's page-locked arena is uploaded where it lies,
  see host_pins.py).
Elsewhere (the CPU engine) the same calls are torch copies.

A group's layers may differ in width (DeepSeek-V3.2: the 656-byte fp8_ds_mla latent and
the 132-byte indexer key share one group). Layers of one shape form a part; an object is
its parts one after the other, each layer-major.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from pdserve.kvstore.connector.plan import UNALLOCATED

# A payload as page-locked host pieces the GPU can read asynchronously, or None (see host_pins.py).
Pinner = Callable[[memoryview], "list[torch.Tensor] | None"]


def _paged_ops() -> tuple[Callable, Callable] | None:
    """pdserve.kernels' single-launch gather/scatter when Triton is there, else None."""
    try:
        from pdserve.kernels import paged
    except ImportError:
        return None
    return paged.gather, paged.scatter


def _copy_rows(dst: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    """dst[idx] = src for byte rows, as 8-byte words where both line up: torch copies uint8
    rows element by element, int64 rows a word at a time (measured: 25x faster for a
    16-block object)."""
    if src.shape[-1] % 8 == 0 and all(t.stride(-1) == 1 and t.data_ptr() % 8 == 0 for t in (dst, src)):
        dst, src = dst.view(torch.int64), src.view(torch.int64)
    dst.index_copy_(0, idx, src)


# A load's objects go to the paged kernels in launches of at most this many bytes: the rows are
# put side by side on the device first, so this bounds the extra device memory a load takes.
SCATTER_BATCH_BYTES = 64 << 20
MAX_LAUNCH_BLOCKS = 65535  # pdserve.kernels.paged's limit on blocks per launch


def _runs(batch: list[tuple[torch.Tensor, torch.Tensor]], max_bytes: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """(rows [layers, blocks, width], block ids) pairs cut into consecutive runs of at most
    `max_bytes` and MAX_LAUNCH_BLOCKS blocks (a pair larger than that is a run of its own)."""
    runs: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    size = blocks = 0
    for src, idx in batch:
        if runs and size + src.numel() <= max_bytes and blocks + src.shape[1] <= MAX_LAUNCH_BLOCKS:
            runs[-1].append((src, idx))
            size, blocks = size + src.numel(), blocks + src.shape[1]
        else:
            runs.append([(src, idx)])
            size, blocks = src.numel(), src.shape[1]
    return runs


COPY_COUNTERS = ("gathers", "gather_bytes", "gather_seconds", "gather_gpu_seconds",
                 "scatter_bytes", "scatter_seconds", "scatter_gpu_seconds")


def _timed_event(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


class _Part:
    """Layers of one shape: uint8 views [num_blocks, bytes_per_block]."""

    def __init__(self, views: list[torch.Tensor]):
        self.views = views
        self.bytes_per_block = views[0].shape[1]

    def object_bytes(self, num_blocks: int) -> int:
        return len(self.views) * num_blocks * self.bytes_per_block

    @property
    def rows(self) -> list[torch.Tensor]:
        """The views as [num_blocks, 1, bytes_per_block]: one 'row' per block for the paged kernels."""
        return [v.unsqueeze(1) for v in self.views]


class GroupCache:
    """One KV cache group's layers, block-major (vLLM hands every backend's cache to
    connectors with the block index leading, so one block of one layer is one contiguous
    byte row whatever the dtype: bf16 MLA latents, fp8_ds_mla pages)."""

    def __init__(self, layers: list[torch.Tensor]):
        if not layers:
            raise ValueError("a KV group without layers")
        num_blocks = layers[0].shape[0]
        by_width: dict[int, list[torch.Tensor]] = {}
        for t in layers:
            if t.shape[0] != num_blocks or not t.is_contiguous():
                raise ValueError(
                    f"PDServeConnector needs block-major contiguous KV caches, got shape {tuple(t.shape)}"
                )
            view = t.view(torch.uint8).view(num_blocks, -1)
            by_width.setdefault(view.shape[1], []).append(view)
        self.parts = [_Part(views) for views in by_width.values()]
        self.views = [v for part in self.parts for v in part.views]
        self.device = layers[0].device
        self.cuda = self.device.type == "cuda"
        self._ops = _paged_ops() if self.cuda else None
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._fence: torch.cuda.Event | None = None
        self._pinned: torch.Tensor | None = None  # the load thread's host staging, reused
        # Bytes and seconds of the copies in and out of the paged cache (device and host sides
        # together), for the engine's /metrics: the connector's copy throughput inside the engine.
        self.copy_counts = dict.fromkeys(COPY_COUNTERS, 0.0)

    def object_bytes(self, num_blocks: int) -> int:
        return sum(part.object_bytes(num_blocks) for part in self.parts)

    # ---------------------------------------------------------------- save
    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """The object over `block_ids` as host bytes, complete when this returns."""
        return self.gather_objects([block_ids])[0]

    def gather_objects(self, block_lists: list[list[int]]) -> list[torch.Tensor]:
        """Several objects as host bytes, complete when this returns: on CUDA one upload of the
        block ids, the copies queued back to back, one download and one wait for all of them."""
        start = time.perf_counter()
        sizes = [self.object_bytes(len(ids)) for ids in block_lists]
        flat = [b for ids in block_lists for b in ids]
        out = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
        began = _timed_event(torch.cuda.current_stream(self.device)) if self.cuda else None
        ids = self._ids(flat)
        offset = pos = 0
        for block_ids in block_lists:
            idx, pos = ids[pos : pos + len(block_ids)], pos + len(block_ids)
            for part in self.parts:
                size = part.object_bytes(len(block_ids))
                dst = out[offset : offset + size].view(len(part.views), len(block_ids), -1)
                offset += size
                if self._ops is not None:
                    self._ops[0](part.rows, idx, out=dst)
                else:
                    for layer, view in enumerate(part.views):
                        torch.index_select(view, 0, idx, out=dst[layer])
        if self.cuda:
            # On the engine's stream: ordered after this step's KV writes, before any later reuse.
            host = torch.empty(out.numel(), dtype=torch.uint8, pin_memory=True)
            host.copy_(out, non_blocking=True)
            ended = _timed_event(torch.cuda.current_stream(self.device))
            ended.synchronize()
            assert began is not None
            self.copy_counts["gather_gpu_seconds"] += began.elapsed_time(ended) / 1e3
            out = host
        self.copy_counts["gathers"] += 1
        self.copy_counts["gather_bytes"] += out.numel()
        self.copy_counts["gather_seconds"] += time.perf_counter() - start
        return list(out.split(sizes))

    def _ids(self, block_ids: list[int]) -> torch.Tensor:
        """Block ids on the caches' device in one copy, checked on the host (the kernels trust them)."""
        ids = torch.tensor(block_ids, dtype=torch.long)
        num_blocks = self.views[0].shape[0]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
            raise IndexError(f"block ids outside [0, {num_blocks})")
        return ids.pin_memory().to(self.device, non_blocking=True) if self.cuda else ids

    # ---------------------------------------------------------------- load
    def fence(self) -> None:
        """Mark the engine's stream now: loads handed over after this wait for what it queued."""
        if self.cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._fence = event

    def scatter(self, payload: memoryview, block_ids: list[int], skip: int) -> None:
        """Write an object back, leaving its first `skip` blocks untouched; complete on return."""
        self.scatter_objects([(payload, block_ids, skip)])

    def scatter_objects(self, objects: list[tuple[memoryview, list[int], int]], pins: Pinner | None = None) -> None:
        """Write several objects back (payload, block ids, leading blocks to leave alone), complete
        on return: on CUDA the uploads (straight from page-locked memory where `pins` says the
        payload is, else staged), the copies queued back to back, one wait."""
        start = time.perf_counter()
        targets = [[i for i in range(skip, len(ids)) if ids[i] != UNALLOCATED] for _, ids, skip in objects]
        flat = [ids[i] for (_, ids, _), keep in zip(objects, targets) for i in keep]
        sizes = [len(payload) for payload, _, _ in objects]
        if not self.cuda:
            payloads = [torch.frombuffer(p, dtype=torch.uint8) for p, _, _ in objects]
            self._scatter_all(objects, targets, self._ids(flat), payloads)
        else:
            assert self._ops is not None and self._stream is not None
            host = self._pinned_payloads(objects, sizes, pins)
            with torch.cuda.stream(self._stream):
                if self._fence is not None:
                    self._stream.wait_event(self._fence)
                began = _timed_event(self._stream)  # after the fence: the engine's work is not ours
                # From pinned memory, so the uploads are asynchronous too: only the synchronize
                # below orders the load.
                self._scatter_all(objects, targets, self._ids(flat), self._upload(host, sizes))
                ended = _timed_event(self._stream)
            # Reported received only once the bytes are in the paged cache (and the staging is free).
            self._stream.synchronize()
            self.copy_counts["scatter_gpu_seconds"] += began.elapsed_time(ended) / 1e3
        self.copy_counts["scatter_bytes"] += sum(sizes)
        self.copy_counts["scatter_seconds"] += time.perf_counter() - start

    def _pinned_payloads(
        self, objects: list[tuple[memoryview, list[int], int]], sizes: list[int], pins: Pinner | None
    ) -> list[list[torch.Tensor]]:
        """Each payload as pinned host pieces: where it lies when `pins` can page-lock it (the
        store's arena) or it is pinned already, else staged into this group's reused buffer."""
        pieces: list[list[torch.Tensor] | None] = []
        for payload, _, _ in objects:
            found = pins(payload) if pins is not None else None
            if found is None:
                whole = torch.frombuffer(payload, dtype=torch.uint8)
                found = [whole] if whole.is_pinned() else None
            pieces.append(found)
        unpinned = [i for i, found in enumerate(pieces) if found is None]
        total = sum(sizes[i] for i in unpinned)
        if total and (self._pinned is None or self._pinned.numel() < total):
            self._pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        offset = 0
        for i in unpinned:
            assert self._pinned is not None
            staged = self._pinned[offset : offset + sizes[i]]
            offset += sizes[i]
            staged.copy_(torch.frombuffer(objects[i][0], dtype=torch.uint8))
            pieces[i] = [staged]
        return [found for found in pieces if found is not None]

    def _upload(self, host: list[list[torch.Tensor]], sizes: list[int]) -> list[torch.Tensor]:
        """The payloads on the device, one after the other in one buffer, from their pinned host
        pieces (queued on the current stream)."""
        out = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
        offset = 0
        for pieces in host:
            for piece in pieces:
                out[offset : offset + piece.numel()].copy_(piece, non_blocking=True)
                offset += piece.numel()
        return list(out.split(sizes))

    def _scatter_all(self, objects: list[tuple[memoryview, list[int], int]], targets: list[list[int]],
                     ids: torch.Tensor, payloads: list[torch.Tensor]) -> None:
        """Each part's rows of every object into their blocks: with the paged kernels, the objects'
        rows side by side and one launch per part for up to SCATTER_BATCH_BYTES of them (a launch
        and its Python cost 50-100 us, and a 32k-token load of a tiny DeepSeek is 128 objects);
        else (the CPU engine) object by object, layer by layer, without the extra copy."""
        batches: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.parts]
        pos = 0
        for (_, block_ids, skip), keep, whole in zip(objects, targets, payloads):
            if not keep:
                continue
            idx, pos = ids[pos : pos + len(keep)], pos + len(keep)
            offset = 0
            for part, batch in zip(self.parts, batches):
                size = part.object_bytes(len(block_ids))
                src = whole[offset : offset + size].view(len(part.views), len(block_ids), -1)
                offset += size
                # a plain run of blocks (the usual case) is a view; only holes make a copy
                src = src[:, skip:] if len(keep) == len(block_ids) - skip else src[:, keep]
                if self._ops is None:
                    for layer, view in enumerate(part.views):
                        _copy_rows(view, idx, src[layer])
                else:
                    batch.append((src, idx))
        for part, batch in zip(self.parts, batches):
            for run in _runs(batch, SCATTER_BATCH_BYTES):
                srcs, idxs = zip(*run)
                rows = srcs[0].contiguous() if len(srcs) == 1 else torch.cat(srcs, dim=1)
                assert self._ops is not None
                self._ops[1](rows, part.rows, idxs[0] if len(idxs) == 1 else torch.cat(idxs))

    def take_copy_counts(self) -> dict[str, float]:
        """Counts since the last take (each counter is written by one thread only)."""
        counts, self.copy_counts = self.copy_counts, dict.fromkeys(COPY_COUNTERS, 0.0)
        return counts
