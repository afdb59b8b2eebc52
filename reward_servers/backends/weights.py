"""A backend's weights, movable between its device and a host copy (issue 38: the host tier).

At load every parameter and buffer of the backend's modules gets a host copy, kept for the
replica's life (the backup the paper's GPU manager keeps in CPU memory, and what the node's
`host_memory_mb` budget is charged for): page-locked ("pinned") on CUDA, so that a restore is one
DMA copy per tensor. `offload` points every tensor at its host copy, which frees the device
memory (the caching allocator's blocks are released with `empty_cache`); `restore` copies the
host copies back to the device. The process, its imports and the tokenizer stay: a restore is a
copy, not a load.

On a CPU-kind instance (no GPU) the "device" is host memory too: `restore` copies the host
copy into a second host buffer and `offload` drops that buffer. It does the same work a GPU
restore does, as a memory copy between two host buffers, and is measured and reported as that.
That buffer is one anonymous mapping advised for transparent huge pages, as CUDA's allocator
hands out 2 MiB blocks: with 4 KiB pages the kernel's first touch of each page cost more than the
copy (all-MiniLM-L6-v2, 91 MB, on this 2-core machine: 117 ms with a plain allocation, 31 ms
with huge pages, 18 ms copying into memory already touched).
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Iterable
from typing import Any

ALIGN = 64  # bytes: every tensor of the CPU "device" buffer starts on a cache line


class Weights:
    """The tensors of `modules`, on `device` or offloaded to their host copies."""

    def __init__(self, torch: Any, modules: Iterable[Any], device: str) -> None:
        self.torch = torch
        self.device = device
        self.cuda = device.startswith("cuda")
        self.tensors: list[Any] = []
        seen: set[int] = set()
        for module in modules:
            for t in [*module.parameters(), *module.buffers()]:
                if id(t) not in seen:  # tied weights (one Parameter in two modules) move once
                    seen.add(id(t))
                    self.tensors.append(t)
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors)
        if self.cuda:
            self.host = [
                torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True).copy_(t.detach())
                for t in self.tensors
            ]
        else:  # the loaded tensors become the host copies; the "device" gets copies of its own
            self.host = [t.detach().contiguous() for t in self.tensors]
            for t, d in zip(self.tensors, self._cpu_buffers(), strict=True):
                t.data = d
        self.on_device = True

    def offload(self) -> float:
        """Free the device copies (the host copies stay); seconds taken."""
        t0 = time.perf_counter()
        if self.on_device:
            for t, h in zip(self.tensors, self.host, strict=True):
                t.data = h
            if self.cuda:
                self.torch.cuda.synchronize(self.device)
                self.torch.cuda.empty_cache()
            self.on_device = False
        return time.perf_counter() - t0

    def restore(self) -> float:
        """Copy the host copies back to the device; seconds taken (the copy is complete)."""
        t0 = time.perf_counter()
        if not self.on_device:
            if self.cuda:
                for t, h in zip(self.tensors, self.host, strict=True):
                    t.data = h.to(self.device, non_blocking=True)
                self.torch.cuda.synchronize(self.device)
            else:
                for t, d in zip(self.tensors, self._cpu_buffers(), strict=True):
                    t.data = d
            self.on_device = True
        return time.perf_counter() - t0

    def _cpu_buffers(self) -> list[Any]:
        """The host copies copied into one fresh buffer (the CPU stand-in for device memory),
        one view per tensor; the buffer goes when the last view does."""
        torch = self.torch
        offsets, size = [], 0
        for h in self.host:
            offsets.append(size)
            size += -(-h.numel() * h.element_size() // ALIGN) * ALIGN
        buf = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                buf.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # transparent huge pages off: plain pages, same result, slower
                pass
        flat = torch.frombuffer(buf, dtype=torch.uint8)
        out = []
        for h, off in zip(self.host, offsets, strict=True):
            d = flat[off : off + h.numel() * h.element_size()].view(h.dtype).view(h.shape)
            out.append(d.copy_(h))
        return out
