"""Live tensor bytes on CPU: a dispatch mode that follows every tensor storage an operator creates or touches.

CPU has no ``torch.cuda.max_memory_allocated``; process RSS mixes in the allocator's caching, Python objects and
libraries. :func:`peak_tracker` instead records, while it is active, every (non-meta) storage that an operator
returns or receives (weakly: a freed storage stops counting), and after every operator that allocated a new
storage sums the bytes of the live ones; the peak is the largest such sum. Storages resized in place (FSDP2 frees
its gathered parameters with ``resize_(0)`` and regrows them) count with their size at that moment. Tensors that
existed before the mode was entered count once an operator touches them. DTensor operators are seen on their local
tensors (the mode lets DTensor run first). With ``B4_DEBUG=1`` in the environment it also keeps, at each new peak,
the operator and the 24 largest live storages (``tracker.at_peak``): what a peak is made of. ``tracker.on_peak``
(a callable taking the operator's name and the live storages as ``(bytes, data_ptr)`` pairs) replaces that: its
result becomes ``tracker.at_peak`` at each new peak.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

DEBUG = os.environ.get("B4_DEBUG") == "1"


def peak_tracker() -> Any:
    """A new tracker (a ``TorchDispatchMode``): ``with tracker: ...``; then ``tracker.peak`` / ``tracker.live()``
    in bytes, ``tracker.reset_peak()`` to start a new phase. Built lazily (torch imports inside)."""
    import torch
    from torch.distributed.tensor import DTensor

    from lightning_3d.core.torch_compat import TorchDispatchMode, tree_leaves

    class PeakTracker(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.storages: dict[int, weakref.ref[Any]] = {}
            self.peak = 0
            self.on_peak: Any = None
            self.at_peak: Any = None

        def _forget(self, key: int) -> Any:
            return lambda _ref: self.storages.pop(key, None)

        def live(self) -> int:
            """Bytes of the storages alive now (each counted once, at its current size)."""
            seen, total = set(), 0
            for ref in list(self.storages.values()):
                st = ref()
                if st is None:
                    continue
                try:
                    ptr, nbytes = st.data_ptr(), st.nbytes()
                except RuntimeError:  # a storage torch invalidated (e.g. swapped out by swap_tensors)
                    continue
                if ptr in seen:
                    continue
                seen.add(ptr)
                total += nbytes
            return total

        def reset_peak(self) -> None:
            self.peak = self.live()

        def _note(self, values: Any) -> bool:
            new = False
            for t in tree_leaves(values):
                # plain tensors only: DTensors come back as their local tensors, fake tensors hold no memory
                if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.is_meta:
                    continue
                try:
                    st = t.untyped_storage()
                except (RuntimeError, NotImplementedError):  # sparse / opaque tensors
                    continue
                key = id(st)
                if key not in self.storages:
                    self.storages[key] = weakref.ref(st, self._forget(key))
                    new = True
            return new

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # let DTensor run: its local operators come back here on plain tensors
            self._note((args, kwargs))
            out = func(*args, **kwargs)
            if self._note(out) or func.namespace in ("c10d", "_c10d_functional"):
                live = self.live()
                if live > self.peak and (DEBUG or self.on_peak is not None):
                    sizes = []
                    for r in self.storages.values():
                        st = r()
                        if st is not None:
                            sizes.append((st.nbytes(), st.data_ptr()))
                    ranked = sorted(set(sizes), reverse=True)
                    self.at_peak = (str(func), ranked[:24]) if self.on_peak is None else self.on_peak(str(func), ranked)
                self.peak = max(self.peak, live)
            return out

    return PeakTracker()
