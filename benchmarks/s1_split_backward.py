"""S1 the zero-bubble schedules' split backward against one whole backward, per stage, on this device.

The zero-bubble schedules (``interleavedzerobubble``, ``zbvzerobubble``, ``dualpipev``, split CSV lists) run a
stage's backward as two actions: ``I`` (the input gradient, sent to the previous stage at once) and later ``W``
(the weight gradients). torch runs them as ``stage_backward_input`` and ``stage_backward_weight``
(``torch.distributed.pipelining._backward``, the functions its ``PipelineStage`` calls): ``I`` walks the autograd
graph in Python to find, for every parameter, the nodes where its gradient path leaves the input's (its
"intermediates"), hooks them, and runs one ``autograd.grad`` for the input with the graph kept; ``W`` runs one
``autograd.grad`` per parameter group from the hooked nodes. A schedule gains from the split only when ``I + W``
costs little more than one whole backward (``B``), which decides whether a zero-bubble schedule can beat 1F1B.

One process, one thread: stages of 1, 2, 4 and 8 blocks of the benchmark GPT (hidden 256, 4 heads, sequence 128,
one micro-batch of one sequence), each round timing, in turn, the forward and a whole backward, then ``I`` and
``W`` on a fresh forward. Rounds alternate the variants so that load drifts hit all alike; figures are medians over
the rounds (after warm-up). ``I + W`` does the same arithmetic as ``B`` (``I`` every input gradient, ``W`` every
weight gradient), so ``B`` is the split's ideal and whatever it costs above ``B`` is overhead: that overhead over
the micro-batch's forward + backward is what a zero-bubble schedule pays per micro-batch, against the bubble it
removes (1F1B's ``(p - 1) / (m + p - 1)`` minus its own: 11% - 2% at pp2 m8).

A third variant times the split the strategy runs by default (``split_backward="linear"``,
``core/weight_grad_store.py``): its forward ``F'`` runs the linear layers through their own autograd function (a
Python call per layer that plain ``F.linear`` does not pay), ``I`` is the whole backward with the linear layers'
weight gradients kept, ``W`` their products (one ``mm`` per layer, no graph walk); its overhead share counts the
forward's excess too: (F' + I + W - F - B) / (F + B).

Record: ``measured`` = the linear split's ``I + W`` at 4 blocks (ms), ``baseline`` = ``ideal`` = ``B`` at 4 blocks,
``ratio`` = measured / baseline (1.0: the split costs nothing); ``details.blocks[n]``: ``split`` / ``I`` / ``W`` and
``overhead_share`` = (I + W - B) / (F + B) for torch's split, ``linear F`` / ``linear`` / ``linear I`` /
``linear W`` and ``linear_overhead_share`` for the linear one; ``held_for_W_MB``: what one micro-batch holds between
its ``I`` and its ``W`` under each split, beside what its forward saved (counted, not timed).
Not in ``all``; run by id: ``python -m benchmarks S1``.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from .common import Record, median

ID, TITLE = "S1", "split backward (zero-bubble I + W) vs one whole backward, per stage of n blocks (1 process)"
BLOCKS = (1, 2, 4, 8)


def measure(config: dict[str, Any], blocks: int, rounds: int, warmup: int) -> dict[str, Any]:
    """Median ms of each variant for a stage of ``blocks`` blocks, the split's halves and its parameter groups."""
    import torch

    from lightning_3d.core import weight_grad_store
    from lightning_3d.core.torch_compat import split_backward_functions

    from .common import build_gpt

    stage_backward_input, stage_backward_weight = split_backward_functions()

    model = build_gpt({**config, "n_layer": blocks})
    stage = torch.nn.Sequential(*list(model.body)[1 : 1 + blocks])
    params = list(stage.parameters())
    # routed as the strategy's stages are under split_backward="linear"; outside ``stage_pass`` they run F.linear
    weight_grad_store.defer_linear_weight_grads([stage])
    seq, width = config["block_size"], config["n_embd"]
    x0 = torch.randn(1, seq, width, generator=torch.Generator().manual_seed(0))
    g0 = torch.randn(1, seq, width, generator=torch.Generator().manual_seed(1))
    groups = 0

    def forward() -> tuple[Any, Any]:
        x = x0.clone().requires_grad_(True)
        return x, stage(x)

    def whole() -> dict[str, float]:
        start = time.perf_counter()
        _, y = forward()
        middle = time.perf_counter()
        torch.autograd.backward(y, g0)
        return {"forward": middle - start, "whole": time.perf_counter() - middle}

    def split() -> dict[str, float]:
        nonlocal groups
        x, y = forward()
        start = time.perf_counter()
        _, param_groups = stage_backward_input([y], [g0], [x], iter(params))
        middle = time.perf_counter()
        stage_backward_weight(iter(params), param_groups)
        end = time.perf_counter()
        groups = len(param_groups)
        return {"split": end - start, "I": middle - start, "W": end - middle}

    def linear() -> dict[str, float]:
        x = x0.clone().requires_grad_(True)
        begin = time.perf_counter()
        with weight_grad_store.stage_pass():  # the forward through the routed layers (their own autograd function)
            y = stage(x)
        start = time.perf_counter()
        with weight_grad_store.stage_pass(), weight_grad_store.deferring() as kept:
            torch.autograd.backward(y, g0)
        middle = time.perf_counter()
        weight_grad_store.run_kept(kept)
        end = time.perf_counter()
        return {"linear F": start - begin, "linear": end - start, "linear I": middle - start, "linear W": end - middle}

    times: dict[str, list[float]] = {}
    for round_ in range(warmup + rounds):
        for fn in (whole, split, linear):
            for p in params:
                p.grad = None
            for key, value in fn().items():
                if round_ >= warmup:
                    times.setdefault(key, []).append(value * 1e3)
    result = {key: median(values) for key, values in times.items()}
    result["overhead_share"] = (result["split"] - result["whole"]) / (result["forward"] + result["whole"])
    # the linear split also routes the forward: its excess counts too
    result["linear_overhead_share"] = (result["linear F"] + result["linear"] - result["forward"] - result["whole"]) / (
        result["forward"] + result["whole"]
    )
    result["param_groups"] = groups
    result["rounds"] = times
    result["held_for_W_MB"] = held_for_w(stage, x0, g0)
    return result


def held_for_w(stage: Any, x0: Any, g0: Any) -> dict[str, float]:
    """Counting, not timing: the MB one micro-batch holds between its ``I`` and its ``W`` under each split, next to
    what its forward saved for the backward (``saved``, B3's tracker: autograd's saved tensors by storage,
    parameters excluded). torch's split keeps the graph, so what is still saved after ``I``; the linear split frees
    the graph in ``I`` and keeps each linear layer's input and output gradient (unique storages)."""
    import torch

    from lightning_3d.core import weight_grad_store
    from lightning_3d.core.torch_compat import split_backward_functions

    from .b3_activations import SavedTensorTracker

    stage_backward_input, stage_backward_weight = split_backward_functions()
    params = list(stage.parameters())
    exclude = {p.untyped_storage().data_ptr() for p in params}
    mb = 2.0**20
    result: dict[str, float] = {}
    for variant in ("torch", "linear"):
        tracker = SavedTensorTracker(exclude)
        x = x0.clone().requires_grad_(True)
        pass_ = weight_grad_store.stage_pass() if variant == "linear" else contextlib.nullcontext()
        with torch.autograd.graph.saved_tensors_hooks(tracker._pack, tracker._unpack), pass_:
            y = stage(x)
        result["saved"] = tracker.rank_live / mb
        if variant == "torch":
            _, groups = stage_backward_input([y], [g0], [x], iter(params))
            result["torch"] = tracker.rank_live / mb
            stage_backward_weight(iter(params), groups)
        else:
            with weight_grad_store.stage_pass(), weight_grad_store.deferring() as kept:
                torch.autograd.backward(y, g0)
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for _, *ts in kept for t in ts}
            live = tracker.rank_live + sum(n for ptr, n in storages.items() if not tracker.holds(ptr))
            result["linear"] = live / mb
            weight_grad_store.run_kept(kept)
        del y
        for p in params:
            p.grad = None
    return result


def run(out: Path, tiny: bool = False) -> Record:
    """Every stage size in turn (one process); the record keeps each variant's rounds."""
    import torch

    from .common import model_config

    torch.set_num_threads(1)
    config = model_config(tiny)
    sizes = BLOCKS[:2] if tiny else BLOCKS
    rounds, warmup = (2, 1) if tiny else (15, 3)
    table = {n: measure(config, n, rounds, warmup) for n in sizes}
    lines = [
        f"one thread; GPT blocks of hidden {config['n_embd']}, sequence {config['block_size']}; medians of {rounds} "
        "rounds (ms)",
        "blocks | forward F | whole B | torch's split I + W (I, W) | / B | (I + W - B) / (F + B) | W's grad calls "
        "| linear split: its forward F' | I + W (I, W) | / B | (F' + I + W - F - B) / (F + B)",
    ]
    for n, row in table.items():
        lines.append(
            f"{n} | {row['forward']:.2f} | {row['whole']:.2f} | {row['split']:.2f} ({row['I']:.2f}, {row['W']:.2f}) | "
            f"{row['split'] / row['whole']:.2f} | {row['overhead_share']:.1%} | {row['param_groups']} | "
            f"{row['linear F']:.2f} | {row['linear']:.2f} ({row['linear I']:.2f}, {row['linear W']:.2f}) | "
            f"{row['linear'] / row['whole']:.2f} | {row['linear_overhead_share']:.1%}"
        )
    lines.append("held between I and W, one micro-batch (MB): blocks | saved by its forward | torch's split | linear")
    for n, row in table.items():
        held = row["held_for_W_MB"]
        lines.append(f"{n} | {held['saved']:.2f} | {held['torch']:.2f} | {held['linear']:.2f}")
    key = 4 if 4 in table else max(table)
    row = table[key]
    return Record(
        ID,
        TITLE,
        round(row["linear"], 3),
        round(row["whole"], 3),
        round(row["whole"], 3),
        round(row["linear"] / row["whole"], 3),
        f"ms per micro-batch (a stage of {key} blocks, split_backward='linear'; torch's split in details)",
        {"blocks": {str(n): row for n, row in table.items()}, "config": config, "rounds": rounds},
        lines,
    )
