"""Stages balanced by estimated compute or memory: per-layer costs and the split that minimises the worst stage.

``partitioner="compute"`` on an ``nn.Sequential`` body MEASURES each layer's forward + backward time at setup
(:func:`measure_layer_times`): the LightningModule's ``example_input_array`` (one micro-batch's input of the body, of
the real shape; real or meta) is passed through the body on the meta device to get every layer's input shape, then
the layers a rank times are copied, materialised on the run's device (``reset_parameters`` under a forked RNG, so
the model's initialisation and the data stream do not change) and run forward + backward on random inputs of their
shapes, the runs interleaved (round ``r`` runs each layer once, so a burst of load hits one run of each layer):
warm-up rounds, then each layer's fastest of a few timed runs (time lost to other processes only ever adds: the
fastest run is the least disturbed one); the last layer is timed with a cross-entropy over its output's last
dimension (the loss the last stage runs). Layers of the same structure, settings and input shape (a transformer's
blocks) are timed once, on the first of them, and share that time: setup stays short for deep models, and timing
noise between copies of one block cannot move the split. On several ranks each rank times every ``world``-th kind
of layer and one ``all_gather_object`` gives every rank the whole table. Every rank
decides from the same gathered table, so every rank takes the same split. The stages minimise the slowest stage's
measured time (:func:`balanced_split`); the embedding (first layer) and the head with the loss (last layer) are
layers like the others.

FLOPs counted on the meta device (``torch.utils.flop_counter``, forward + backward, no compute) are the fallback,
with a warning saying why, when timing is impossible: a layer cannot be materialised or run on the device (no
``reset_parameters`` for its meta tensors, an input that is not one tensor, out of memory), on any rank (the
errors travel in the same gather, so every rank falls back alike), and ``ComputePartitioner(measure=False)``.
FLOPs miss memory-bound work (the loss, normalisations); the example's sequence length changes the split, its
batch size does not.

Models split at their block container are timed inside one forward + backward of the whole model
(:func:`measure_block_times`: their blocks take keyword arguments and return tuples, so a block is not called
alone); their FLOP fallback is :func:`block_profiles`.

``partitioner="memory"`` estimates each stage's peak bytes: parameters, their gradients and two optimizer-state
tensors each (Adam), plus the bytes autograd saves for backward per micro-batch (counted on the meta device)
times the micro-batches the schedule keeps in flight on the stage (``MemoryPartitioner.for_schedule``, with the
counts of ``pipeline.activations_in_flight``, which the strategy passes), 1F1B's ``p - s`` on stage ``s`` of ``p``
when no schedule is given. Under activation checkpointing (``for_schedule(..., checkpointing)``) a checkpointed block
keeps only its input per micro-batch in flight (selective: also the outputs of the operations it saves, counted on
the meta device) and its stage adds the largest checkpointed block's recomputation, which lives during that block's
backward.

Models split at their block container (not an ``nn.Sequential`` body) are profiled whole, in one forward and
backward on the meta device (:func:`block_profiles`): each block's forward FLOPs (times 3 for forward + backward)
and saved bytes are attributed by hooks on the blocks; the work and parameters before the first block (the
embeddings) count on the first block, the rest (final norm, head, loss-free output) on the last one.

:func:`balanced_split` is the dynamic programme over contiguous split points that both use.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

from . import torch_compat
from .blocks import sequential_blocks
from .checkpointing import chosen_blocks, saved_ops
from .pieces import NotOneTensor, layer_of, meta_inputs

Profile = tuple[float, ...]
"""A layer's ``(flops or seconds, static_bytes, activation_bytes[, input_bytes, selective_bytes])``."""

StageCost = Callable[[int, int, int], float]
"""``cost(stage, start, stop)``: the cost of stage ``stage`` holding layers ``start .. stop - 1``."""

OPTIMIZER_STATES = 2  # Adam's exp_avg and exp_avg_sq per parameter


def balanced_split(num_layers: int, num_stages: int, cost: StageCost) -> list[range]:
    """Contiguous, non-empty stages minimising the largest stage cost (ties: the smaller sum of stage costs).

    Args:
        num_layers: layers to split (``>= num_stages``).
        num_stages: stages.
        cost: the cost of a stage holding a range of layers (may depend on the stage's index).

    Returns:
        ``num_stages`` ranges covering ``0 .. num_layers - 1`` in order.
    """
    if num_layers < num_stages:
        raise ValueError(f"{num_layers} layers cannot fill {num_stages} stages")
    inf = (float("inf"), float("inf"))
    # best[s][j]: (worst stage, total) for stages 0..s-1 holding layers 0..j-1
    best = [[inf] * (num_layers + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, num_stages + 1):
        for j in range(s, num_layers - (num_stages - s) + 1):
            for i in range(s - 1, j):
                prev = best[s - 1][i]
                if prev == inf:
                    continue
                c = cost(s - 1, i, j)
                cand = (max(prev[0], c), prev[1] + c)
                if cand < best[s][j]:
                    best[s][j], cut[s][j] = cand, i
    ranges, j = [], num_layers
    for s in range(num_stages, 0, -1):
        i = cut[s][j]
        ranges.append(range(i, j))
        j = i
    return ranges[::-1]


def rank_balanced(
    partitioner: Any, layers: Sequence[tuple[str, nn.Module]], ranges: Sequence[range], placement: Sequence[int]
) -> list[range]:
    """``ranges`` (the stage split :func:`balanced_split` chose) moved, boundary by boundary, so that the busiest
    pipeline rank's stages together cost as little as possible, when ranks hold several stages.

    :func:`balanced_split` minimises the slowest *stage*; under an interleaved or V placement a rank runs all its
    stages for every micro-batch, so the busiest *rank* sets the pace (and, for memory, holds the most). From the
    stage split, the best single move of one boundary by one layer is taken while it lowers ``(busiest rank,
    costliest stage)``; the result is never worse than the stage split. One stage per rank: returned unchanged.
    Deterministic, so every rank refines the same gathered table to the same split.

    Args:
        partitioner: the compute or memory partitioner that chose ``ranges`` (its costs, profiled once).
        layers: the layers split.
        ranges: the stage split.
        placement: ``placement[s]`` is the pp rank running stage ``s``.
    """
    if len(set(placement)) == len(placement):
        return list(ranges)
    prof = partitioner._profiles(layers)
    num_stages = len(ranges)
    bounds = [r.start for r in ranges] + [ranges[-1].stop]

    def key(b: list[int]) -> tuple[float, float]:
        costs = [partitioner._cost(prof, num_stages, s, b[s], b[s + 1]) for s in range(num_stages)]
        per_rank: dict[int, float] = {}
        for s, c in enumerate(costs):
            per_rank[placement[s]] = per_rank.get(placement[s], 0.0) + c
        return max(per_rank.values()), max(costs)

    best = key(bounds)
    for _ in range(len(layers) * num_stages):  # each move strictly improves; this only bounds the loop
        moves = []
        for k in range(1, num_stages):
            for step in (-1, 1):
                moved = [*bounds[:k], bounds[k] + step, *bounds[k + 1 :]]
                if moved[k - 1] < moved[k] < moved[k + 1]:
                    moves.append((key(moved), moved))
        if not moves:
            break
        score, moved = min(moves)
        if score >= best:
            break
        best, bounds = score, moved
    return [range(bounds[s], bounds[s + 1]) for s in range(num_stages)]


def _meta(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(tensor, device="meta")


class _KeptBytes(torch_compat.TorchDispatchMode):
    """Adds up the bytes of the outputs of the operations selective checkpointing keeps (``saved_ops``), while
    ``active``."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes, self.active = 0.0, True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.active and func in saved_ops():
            outs = out if isinstance(out, (tuple, list)) else (out,)
            self.bytes += sum(t.numel() * t.element_size() for t in outs if isinstance(t, torch.Tensor))
        return out


def _tensor_bytes(value: Any) -> float:
    return float(value.numel() * value.element_size()) if isinstance(value, torch.Tensor) else 0.0


def layer_profiles(layers: Sequence[tuple[str, nn.Module]], example: Any) -> list[Profile]:
    """``(flops, static_bytes, activation_bytes, input_bytes, selective_bytes)`` of each layer, run one after the
    other on ``example`` (meta).

    ``flops`` counts forward and backward; ``static_bytes`` is parameters, gradients and optimizer states;
    ``activation_bytes`` what autograd saves for the backward of one call on ``example``; ``input_bytes`` the
    layer's input (what a checkpointed layer keeps) and ``selective_bytes`` that plus the outputs of the
    operations selective checkpointing keeps.
    """
    x: Any = example.to("meta") if isinstance(example, torch.Tensor) else example
    out = []
    for _, layer in layers:
        params = {n: _meta(p).requires_grad_(p.requires_grad) for n, p in layer.named_parameters()}
        buffers = {n: _meta(b) for n, b in layer.named_buffers()}
        inp = x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x
        saved: dict[int, int] = {}
        weights = frozenset(id(p) for p in params.values())  # saved parameters are counted as static bytes

        def pack(t: torch.Tensor, saved: dict[int, int] = saved, weights: frozenset[int] = weights) -> torch.Tensor:
            base = torch_compat.view_base(t)
            if id(t) not in weights and (base is None or id(base) not in weights):  # a weight's transpose: static
                saved[id(t)] = t.numel() * t.element_size()
            return t

        kept = _KeptBytes()
        with FlopCounterMode(display=False) as counter:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), kept:
                y = functional_call(layer, {**params, **buffers}, (inp,))
            if isinstance(y, torch.Tensor) and y.requires_grad:
                y.backward(torch.empty_like(y))
        static = sum(p.numel() * p.element_size() for p in params.values()) * (2 + OPTIMIZER_STATES)
        held = _tensor_bytes(inp)
        out.append(
            (float(counter.get_total_flops()), float(static), float(sum(saved.values())), held, held + kept.bytes)
        )
        x = y.detach() if isinstance(y, torch.Tensor) else y
    return out


class TimingUnavailable(RuntimeError):
    """Timing the layers was impossible on some rank (the message says which layer and why)."""


TIMED_RUNS = 5  # timed forward + backward runs per layer (the fastest counts)
WARMUP_RUNS = 2  # untimed runs first (allocations, kernel selection)


def _gather_tables(mine: Any, world: int) -> list[Any]:
    """Every rank's timing table (an all-gather when ``world`` > 1); a rank whose timing failed sends its error
    as a string instead, and then every rank raises ``TimingUnavailable`` with all the errors (and falls back
    alike)."""
    tables: list[Any] = [mine]
    if world > 1:
        tables = [None] * world
        dist.all_gather_object(tables, mine)
    errors = [t for t in tables if isinstance(t, str)]
    if errors:
        raise TimingUnavailable("; ".join(errors))
    return tables


def timing_device() -> torch.device:
    """Where the layers are timed: the current CUDA device under an NCCL process group (the strategy has set it),
    else the CPU (gloo runs, and a process without a process group)."""
    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _meta_inputs(layers: Sequence[tuple[str, nn.Module]], example: Any) -> list[torch.Tensor]:
    """Each layer's input on the meta device (shape and dtype), the example passed through the body on meta."""
    try:
        return meta_inputs(layers, example)
    except NotOneTensor as err:
        raise TimingUnavailable(str(err)) from None


_PLAIN = (int, float, bool, str, type(None))


def _signature(layer: nn.Module, inp: torch.Tensor, last: bool) -> tuple[Any, ...]:
    """Layers with equal signatures do the same work: the same classes, parameter shapes and plain settings
    (an attention window, a dropout rate: every public int / float / bool / str attribute of every submodule), on
    inputs of the same shape; the last layer (timed with the loss) is its own."""
    shapes = tuple((n, tuple(p.shape), p.dtype) for n, p in layer.named_parameters())
    settings = tuple(
        (name, type(sub).__qualname__, tuple(sorted((k, repr(v)) for k, v in vars(sub).items() if _is_setting(k, v))))
        for name, sub in layer.named_modules()
    )
    return (shapes, settings, tuple(inp.shape), inp.dtype, last)


def _is_setting(key: str, value: Any) -> bool:
    return not key.startswith("_") and key != "training" and isinstance(value, _PLAIN)


@contextlib.contextmanager
def _no_gc() -> Any:
    """Python's garbage collector off while timing (as ``timeit`` does): its pauses land at the same allocation
    count in every run, so they would add the same milliseconds to one layer every time (measured: 10 ms on a
    0.1 ms head)."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_layers(
    layers: Sequence[tuple[str, nn.Module, torch.Tensor, torch.Tensor | None, bool]],
    device: torch.device,
    runs: int = TIMED_RUNS,
) -> list[float]:
    """Fastest seconds of one forward + backward of a copy of each layer on ``device`` (the layers are untouched).

    The copies are made first and the runs interleaved (round ``r`` runs every layer once), so that a burst of load
    from other processes hits one run of each layer rather than every run of one.

    Args:
        layers: ``(name, layer, input, example, loss)`` each: the layer (real or meta; a copy is materialised on
            ``device`` with ``reset_parameters``, seeded by ``name``, and dropped), its input's shape and dtype
            (floating inputs are random and need their gradient), the real input to use instead when not on the
            meta device (the first layer's token ids), and whether to end with a cross-entropy over the output's
            last dimension (the last layer: the loss runs on its stage).
        device: where to time.
        runs: timed runs per layer after :data:`WARMUP_RUNS` untimed ones.

    Returns:
        Each layer's fastest timed run, in seconds.
    """
    # The run's generators are left as they were: the copies' initialisation, the random inputs and any dropout
    # draw from forked states, so the model's initialisation and the data order do not depend on the partitioner.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        steps = [_prepare(*spec, device) for spec in layers]
        times: list[list[float]] = [[] for _ in steps]
        with _no_gc():
            for run in range(WARMUP_RUNS + runs):
                for k, step in enumerate(steps):
                    _sync(device)
                    start = time.perf_counter()
                    step()
                    _sync(device)
                    if run >= WARMUP_RUNS:
                        times[k].append(time.perf_counter() - start)
    return [min(t) for t in times]


def time_layer(
    layer: nn.Module,
    inp: torch.Tensor,
    device: torch.device,
    *,
    name: str = "",
    example: torch.Tensor | None = None,
    loss: bool = False,
    runs: int = TIMED_RUNS,
) -> float:
    """:func:`time_layers` for one layer."""
    return time_layers([(name, layer, inp, example, loss)], device, runs)[0]


def _prepare(
    name: str, layer: nn.Module, inp: torch.Tensor, example: torch.Tensor | None, loss: bool, device: torch.device
) -> Callable[[], None]:
    """A materialised copy of ``layer`` and its input, as one forward + backward to call."""
    from .materialize import materialize  # imported here: materialize is a heavier module than this one

    work = copy.deepcopy(layer)
    if any(t.is_meta for t in [*work.parameters(), *work.buffers()]):
        materialize(work, device, 0, name)
    else:
        work = work.to(device)
    if example is not None and not example.is_meta:
        x0 = example.to(device)
    elif inp.is_floating_point():
        x0 = torch.randn(inp.shape, dtype=inp.dtype, device=device)
    else:
        x0 = torch.zeros(inp.shape, dtype=inp.dtype, device=device)  # token ids: 0 is a valid id

    def step() -> None:
        x = x0.detach().requires_grad_(x0.is_floating_point())
        y = work(x)
        if not isinstance(y, torch.Tensor):
            raise TimingUnavailable(f"layer {name!r} returns a {type(y).__name__}, not one tensor")
        if loss and y.is_floating_point() and y.dim() > 1 and y.shape[-1] > 1:
            logits = y.float().flatten(0, -2)
            target = torch.zeros(logits.shape[0], dtype=torch.long, device=device)
            torch.nn.functional.cross_entropy(logits, target).backward()
        elif y.requires_grad:
            y.backward(torch.ones_like(y))

    return step


def measure_layer_times(
    layers: Sequence[tuple[str, nn.Module]],
    example: Any,
    *,
    device: torch.device | None = None,
    runs: int = TIMED_RUNS,
) -> list[float]:
    """Each layer's forward + backward seconds on one micro-batch, the same list on every rank (see the module
    docstring): each rank times every ``world``-th layer, one ``all_gather_object`` (when a process group is
    initialised) shares the table; layers of equal structure, settings and input shape (a transformer's blocks)
    are timed once, on their first, and share that time.

    Args:
        layers: the body's layers, in order (real or meta).
        example: one micro-batch's input of the body (a tensor; real or meta).
        device: where to time (default :func:`timing_device`).
        runs: timed runs per layer.

    Returns:
        One time per layer, in seconds.

    Raises:
        TimingUnavailable: some rank could not time its layers (every rank raises it alike).
    """
    device = device if device is not None else timing_device()
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    mine: dict[int, float] | str
    groups: list[list[int]] = []
    try:
        inputs = _meta_inputs(layers, example)
        by_signature: dict[tuple[Any, ...], list[int]] = {}
        for i, (_, layer) in enumerate(layers):
            by_signature.setdefault(_signature(layer, inputs[i], i == len(layers) - 1), []).append(i)
        groups = list(by_signature.values())  # the same on every rank: built from the model alone
        share = _share(groups, layers, rank, world)
        specs = []
        for g in share:
            i = groups[g][0]
            first = example if i == 0 and isinstance(example, torch.Tensor) else None
            specs.append((layers[i][0], layers[i][1], inputs[i], first, i == len(layers) - 1))
        mine = dict(zip((groups[g][0] for g in share), time_layers(specs, device, runs)))  # by layer index
    except Exception as err:  # any failure means FLOPs, on every rank alike (the error is sent in the gather)
        mine = f"rank {rank}: {type(err).__name__}: {err}"
    tables = _gather_tables(mine, world if distributed else 1)
    measured = {i: t for table in tables for i, t in table.items()}
    if any(members[0] not in measured for members in groups):  # the ranks grouped the layers differently
        raise TimingUnavailable("the ranks do not see the same layers (their kinds differ)")
    out = [0.0] * len(layers)
    for members in groups:
        for i in members:
            out[i] = measured[members[0]]
    return out


def _share(groups: Sequence[list[int]], layers: Sequence[tuple[str, nn.Module]], rank: int, world: int) -> list[int]:
    """The kinds of layer (indices into ``groups``) this rank times: every ``world``-th family, where the pieces of
    one layer (``pieces.py``: a block's attention and MLP halves) are one family, timed on one rank so that their
    proportion does not mix two ranks' speeds."""
    families: dict[str, int] = {}
    # a kind's first member names its layer: both halves of the first block for the halves of every block
    family_of = [families.setdefault(layer_of(layers[members[0]][0]), len(families)) for members in groups]
    return [g for g, family in enumerate(family_of) if family % world == rank]


def _first_float(value: Any) -> torch.Tensor | None:
    """The first floating-point tensor in ``value`` (a tensor, a tuple / list, a dict or a model output)."""
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    for item in items:
        found = _first_float(item)
        if found is not None:
            return found
    return None


def _real_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A real tensor for timing in place of ``t``: small random values for floating point, zeros otherwise."""
    if t.is_floating_point():
        return torch.randn(t.shape, dtype=t.dtype, device=device) * 0.02
    return torch.zeros(t.shape, dtype=t.dtype, device=device)


def time_blocks_in_model(
    module: nn.Module, blocks: Sequence[nn.Module], example: Any, device: torch.device, runs: int = TIMED_RUNS
) -> list[float]:
    """Forward + backward seconds inside one forward + backward of the whole ``module``: the work before the first
    block (embeddings), each block's, and the work after the last (final norm, head, a cross-entropy over the
    output's last dimension): ``len(blocks) + 2`` numbers.

    The module runs under ``functional_call`` with real copies of its parameters and buffers on ``device`` (small
    random values; the module's own tensors, meta or real, are untouched); hooks stamp the time when each block's
    forward starts and, in the backward, when the gradient of each block's input and of the last block's output
    arrives (the device is synchronised at each stamp). Each block's fastest of ``runs`` runs after
    :data:`WARMUP_RUNS`.
    """
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        tensors = {n: _real_like(t, device) if t.is_meta else t.detach().to(device) for n, t in _named_tensors(module)}
        for name, param in module.named_parameters():
            tensors[name].requires_grad_(param.requires_grad)
        inp = example.to(device) if isinstance(example, torch.Tensor) and not example.is_meta else example
        if isinstance(inp, torch.Tensor) and inp.is_meta:
            inp = _real_like(inp, device)
        n = len(blocks)
        stamps: dict[str, list[float]] = {}

        def stamp(key: str, i: int) -> None:
            _sync(device)
            stamps.setdefault(key, [0.0] * n)[i] = time.perf_counter()

        def on_grad(key: str, i: int) -> Callable[[torch.Tensor], None]:
            return lambda _grad: stamp(key, i)

        def pre(i: int) -> Callable[..., None]:
            def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                stamp("fwd", i)
                x = _first_float((args, kwargs))
                if x is not None and x.requires_grad:
                    x.register_hook(on_grad("bwd_in", i))

            return hook

        def post(i: int) -> Callable[..., None]:
            def hook(_: nn.Module, args: Any, output: Any) -> None:
                if i == n - 1:
                    stamp("fwd_end", 0)
                    y = _first_float(output)
                    if y is not None and y.requires_grad:
                        y.register_hook(on_grad("bwd_out", 0))

            return hook

        handles = [b.register_forward_pre_hook(pre(i), with_kwargs=True) for i, b in enumerate(blocks)]
        handles += [b.register_forward_hook(post(i)) for i, b in enumerate(blocks)]
        per_run: list[list[float]] = []
        try:
            with _no_gc():
                for run in range(WARMUP_RUNS + runs):
                    stamps.clear()
                    _sync(device)
                    start = time.perf_counter()
                    out = _first_float(functional_call(module, tensors, (inp,)))
                    if out is None or not out.requires_grad:
                        raise TimingUnavailable("the model's output has no floating-point tensor to run backward from")
                    if out.dim() > 1 and out.shape[-1] > 1:
                        logits = out.float().flatten(0, -2)
                        loss = torch.nn.functional.cross_entropy(
                            logits, torch.zeros(logits.shape[0], dtype=torch.long, device=device)
                        )
                    else:
                        loss = out.float().sum()
                    _sync(device)
                    backward_start = time.perf_counter()
                    loss.backward()
                    _sync(device)
                    end = time.perf_counter()
                    for param in tensors.values():
                        param.grad = None
                    if set(stamps) != {"fwd", "fwd_end", "bwd_in", "bwd_out"} or 0.0 in [
                        *stamps["fwd"],
                        *stamps["bwd_in"],
                    ]:
                        raise TimingUnavailable(f"the block hooks did not all fire ({sorted(stamps)})")
                    fwd, bwd_in = stamps["fwd"], stamps["bwd_in"]
                    forward = [fwd[i + 1] - fwd[i] for i in range(n - 1)] + [stamps["fwd_end"][0] - fwd[n - 1]]
                    backward = [bwd_in[i] - bwd_in[i + 1] for i in range(n - 1)] + [
                        bwd_in[n - 1] - stamps["bwd_out"][0]
                    ]
                    prefix = (fwd[0] - start) + (end - bwd_in[0])  # embeddings, forward and backward
                    suffix = (backward_start - stamps["fwd_end"][0]) + (stamps["bwd_out"][0] - backward_start)
                    costs = [prefix, *(f + b for f, b in zip(forward, backward)), suffix]
                    if run >= WARMUP_RUNS:
                        per_run.append(costs)
        finally:
            for handle in handles:
                handle.remove()
    return [min(run[i] for run in per_run) for i in range(n + 2)]


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(), *module.named_buffers()]


def measure_block_times(
    module: nn.Module, blocks: Sequence[nn.Module], example: Any, *, device: torch.device | None = None
) -> list[float]:
    """:func:`time_blocks_in_model` on every rank at once, one ``all_gather_object``, and each piece's fastest
    time over the ranks: the same table on every rank. Blocks of equal structure and settings share the median of
    their times (noise between copies of one block does not move the split); the embeddings count on the first
    block, the head and the loss on the last.

    Raises:
        TimingUnavailable: some rank could not time the model (every rank raises it alike).
    """
    device = device if device is not None else timing_device()
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    mine: list[float] | str
    try:
        mine = time_blocks_in_model(module, blocks, example, device)
    except Exception as err:  # any failure means FLOPs, on every rank alike (the error is sent in the gather)
        mine = f"rank {dist.get_rank() if distributed else 0}: {type(err).__name__}: {err}"
    tables = _gather_tables(mine, world if distributed else 1)
    fastest = [min(t[i] for t in tables) for i in range(len(blocks) + 2)]
    groups: dict[tuple[Any, ...], list[int]] = {}
    anything = torch.empty(0, device="meta")  # blocks of one model take inputs of one shape
    for i, block in enumerate(blocks):
        groups.setdefault(_signature(block, anything, False), []).append(i)
    out = [0.0] * len(blocks)
    for members in groups.values():
        shared = sorted(fastest[i + 1] for i in members)[(len(members) - 1) // 2]  # the (lower) median
        for i in members:
            out[i] = shared
    out[0] += fastest[0]
    out[-1] += fastest[-1]
    return out


BACKWARD_FACTOR = 3.0  # forward + backward FLOPs over forward FLOPs (the backward of a matrix product: two)


def block_profiles(module: nn.Module, blocks: Sequence[nn.Module], example: Any) -> list[Profile]:
    """``(flops, static_bytes, activation_bytes, input_bytes, selective_bytes)`` of each block of ``module``
    (as :func:`layer_profiles`), from one forward of the whole module on ``example`` on the meta device (see the
    module docstring); a block's input is its first tensor argument (the hidden states).

    Args:
        module: the model (its ``forward`` takes ``example``); its parameters are replaced by meta copies.
        blocks: the block modules, in order.
        example: one micro-batch's input of ``module``.

    Returns:
        One tuple per block, the embeddings counted on the first block and the head on the last.
    """
    # Fake tensors (on the meta device) rather than plain meta ones: a model may read a value while it runs
    # (Hugging Face's masks ask whether the positions are packed, `.all()`), which fails on meta tensors; on fake
    # tensors it knows it is being traced and skips the question. Every tensor below is made inside the mode, so
    # the saved-tensor hook recognises the weights by identity.
    with torch_compat.fake_tensor_mode():
        params = {n: _meta(p).requires_grad_(p.requires_grad) for n, p in module.named_parameters()}
        buffers = {n: _meta(b) for n, b in module.named_buffers()}
        by_id = {id(p): n for n, p in module.named_parameters()}
        in_block = {by_id[id(p)]: i for i, b in enumerate(blocks) for p in b.parameters() if id(p) in by_id}
        n = len(blocks)
        flops, saved = [0.0] * n, [0.0] * n
        static, inputs, kept_by_block = [0.0] * n, [0.0] * n, [0.0] * n
        kept = _KeptBytes()
        kept.active = False  # inside the blocks only
        state = {"current": 0, "mark": 0.0, "kept": 0.0}
        # outside the blocks, a module's parameters count where the forward first calls it (before the blocks:
        # the first; after them: the last, whatever the registration order: OPT's final norm)
        in_blocks = {id(m) for b in blocks for m in b.modules()}
        outside = [(name, m) for name, m in module.named_modules() if id(m) not in in_blocks]
        started = [False]
        called_after: dict[str, bool] = {}

        def called(name: str) -> Callable[..., None]:
            def hook(*_: Any) -> None:
                called_after.setdefault(name, started[0])

            return hook

        weights = frozenset(id(p) for p in params.values())

        def pack(t: torch.Tensor) -> torch.Tensor:
            base = torch_compat.view_base(t)
            if id(t) not in weights and (base is None or id(base) not in weights):
                saved[state["current"]] += t.numel() * t.element_size()
            return t

        with FlopCounterMode(display=False) as counter:

            def enter(index: int) -> Callable[..., None]:
                def hook(_: nn.Module, args: Any, kwargs: Any) -> None:
                    flops[state["current"]] += counter.get_total_flops() - state["mark"]
                    state["current"], state["mark"] = index, float(counter.get_total_flops())
                    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
                    inputs[index] += _tensor_bytes(first)
                    kept.active, state["kept"] = True, kept.bytes
                    started[0] = True

                return hook

            def leave(index: int) -> Callable[..., None]:
                def hook(*_: Any) -> None:
                    flops[index] += counter.get_total_flops() - state["mark"]
                    state["current"], state["mark"] = index, float(counter.get_total_flops())
                    kept_by_block[index] += kept.bytes - state["kept"]
                    kept.active = False

                return hook

            handles = [b.register_forward_pre_hook(enter(i), with_kwargs=True) for i, b in enumerate(blocks)]
            handles += [b.register_forward_hook(leave(i)) for i, b in enumerate(blocks)]
            handles += [m.register_forward_pre_hook(called(name)) for name, m in outside]
            try:
                inp = _meta(example) if isinstance(example, torch.Tensor) else example
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), kept:
                    functional_call(module, {**params, **buffers}, (inp,))
                flops[state["current"]] += counter.get_total_flops() - state["mark"]  # the head, after the last block
            finally:
                for handle in handles:
                    handle.remove()
        for name, param in params.items():
            owner_name = name.rpartition(".")[0]
            if name in in_block:
                owner = in_block[name]
            elif owner_name in called_after:
                owner = n - 1 if called_after[owner_name] else 0
            else:
                owner = n - 1 if _after_blocks(module, blocks, name) else 0
            static[owner] += param.numel() * param.element_size() * (2 + OPTIMIZER_STATES)
    return [
        (f * BACKWARD_FACTOR, st, sv, held, held + k)
        for f, st, sv, held, k in zip(flops, static, saved, inputs, kept_by_block)
    ]


def _after_blocks(module: nn.Module, blocks: Sequence[nn.Module], name: str) -> bool:
    """Whether parameter ``name`` (outside the blocks) is registered after the blocks in the module (a head)."""
    order = [id(m) for m in module.modules()]
    owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
    last_block = max(order.index(id(b)) for b in blocks)
    return id(owner) in order and order.index(id(owner)) > last_block


class _Balanced:
    """Shared by the compute and memory partitioners: profile the layers on the example, then split."""

    kind = ""

    def __init__(self, example_input: Any = None, profiles: list[Profile] | None = None) -> None:
        self.example_input = example_input
        self.profiles = profiles
        self._cache: tuple[tuple[int, ...], list[Profile]] | None = None

    def for_input(self, example_input: Any) -> _Balanced:
        """The same partitioner profiling on ``example_input`` (one micro-batch's input of the body)."""
        return type(self)(example_input)

    def for_blocks(self, module: nn.Module, blocks: Sequence[nn.Module], example_input: Any) -> _Balanced:
        """The same partitioner over the blocks of a model split at its block container, profiled by
        :func:`block_profiles` on the module's ``example_input`` (refused without one)."""
        if example_input is None:
            return type(self)(None)  # fails with the message of _profiles when used
        return type(self)(example_input, block_profiles(module, blocks, example_input))

    def _profiles(self, layers: Sequence[tuple[str, nn.Module]]) -> list[Profile]:
        """The layers' profiles, made once per list of layers: the split, the rank refinement and the print-out
        all read them (the compute partitioner's timing is a collective)."""
        key = tuple(id(m) for _, m in layers)
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self._make_profiles(layers))
        return self._cache[1]

    def _make_profiles(self, layers: Sequence[tuple[str, nn.Module]]) -> list[Profile]:
        if self.profiles is not None:
            return self.profiles
        if self.example_input is None:
            raise ValueError(
                f"partitioner={self.kind!r} profiles each layer on an example input: set the LightningModule's "
                "example_input_array to one micro-batch's input of the model (a tensor of the real shape; on the "
                "meta device is fine), or use partitioner='uniform' or 'parameters'."
            )
        return layer_profiles(layers, self.example_input)

    def stage_costs(self, layers: Sequence[tuple[str, nn.Module]], ranges: Sequence[range]) -> list[float]:
        """Each stage's estimate under this partitioner (what the layout print-out shows)."""
        prof = self._profiles(layers)
        return [self._cost(prof, len(ranges), s, r.start, r.stop) for s, r in enumerate(ranges)]

    def _cost(self, prof: list[Profile], num_stages: int, s: int, i: int, j: int) -> float:
        raise NotImplementedError

    def __call__(self, layers: Sequence[tuple[str, nn.Module]], num_stages: int) -> list[range]:
        prof = self._profiles(layers)
        return balanced_split(len(layers), num_stages, lambda s, i, j: self._cost(prof, num_stages, s, i, j))

    def describe(self, cost: float, stage: int | None = None) -> str:
        """A stage's estimate as the layout print-out shows it (``stage``: its index, when the text depends on it)."""
        raise NotImplementedError


class ComputePartitioner(_Balanced):
    """Contiguous stages minimising the slowest stage's measured forward + backward time (FLOPs as the fallback;
    see the module docstring).

    Over a Sequential body it is given the layers cut where one tensor crosses (``split_layers``, ``pieces.py``),
    and puts a stage boundary inside a layer only when that lowers the slowest stage by :attr:`MIN_GAIN` or more
    than the best split between whole layers (both from the same measured pieces).

    Args:
        example_input: one micro-batch's input of the body.
        profiles: per-layer FLOP profiles already made (models split at their blocks); given, nothing is timed.
        measure: time the layers (``False``: count FLOPs only).
        device: where to time (default :func:`timing_device`).
        split_layers: over a Sequential body, also consider boundaries inside layers (``False``: whole layers).
    """

    kind = "compute"
    MIN_GAIN = 0.01  # a boundary inside a layer must make the slowest stage at least this much faster

    def __init__(
        self,
        example_input: Any = None,
        profiles: list[Profile] | None = None,
        measure: bool = True,
        device: torch.device | None = None,
        split_layers: bool = True,
    ) -> None:
        super().__init__(example_input, profiles)
        self.measure, self.device, self.split_layers = measure, device, split_layers
        self.measured = False  # whether the costs are measured seconds (else FLOPs)
        self.fallback: str | None = None  # why FLOPs were used although timing was asked for

    def for_input(self, example_input: Any) -> ComputePartitioner:
        return type(self)(example_input, measure=self.measure, device=self.device, split_layers=self.split_layers)

    def for_blocks(self, module: nn.Module, blocks: Sequence[nn.Module], example_input: Any) -> ComputePartitioner:
        """The blocks of a model split at its block container, timed inside the whole model
        (:func:`measure_block_times`), or their FLOPs (:func:`block_profiles`) when timing is impossible."""
        if example_input is None or not self.measure:
            return super().for_blocks(module, blocks, example_input)  # type: ignore[return-value]
        try:
            times = measure_block_times(module, blocks, example_input, device=self.device)
        except TimingUnavailable as err:
            part = super().for_blocks(module, blocks, example_input)
            part.fallback = str(err)  # type: ignore[attr-defined]
            warnings.warn(
                f"lightning_3d: partitioner='compute' could not time the blocks ({err}); the stages are balanced by "
                "forward + backward FLOPs counted on the meta device instead.",
                stacklevel=2,
            )
            return part  # type: ignore[return-value]
        part = type(self)(example_input, [(t, 0.0, 0.0) for t in times], device=self.device)
        part.measured = True
        return part

    def _make_profiles(self, layers: Sequence[tuple[str, nn.Module]]) -> list[Profile]:
        if self.profiles is not None or not self.measure or self.example_input is None:
            return super()._make_profiles(layers)
        try:
            times = measure_layer_times(layers, self.example_input, device=self.device)
        except TimingUnavailable as err:
            self.fallback = str(err)
            warnings.warn(
                f"lightning_3d: partitioner='compute' could not time the layers ({err}); the stages are "
                "balanced by forward + backward FLOPs counted on the meta device instead.",
                stacklevel=2,
            )
            return super()._make_profiles(layers)
        self.measured = True
        return [(t, 0.0, 0.0) for t in times]

    def _cost(self, prof: list[Profile], num_stages: int, s: int, i: int, j: int) -> float:
        return sum(p[0] for p in prof[i:j])

    def __call__(self, layers: Sequence[tuple[str, nn.Module]], num_stages: int) -> list[range]:
        """The best split of ``layers``; where they include pieces of layers, the best split between whole layers
        unless cutting inside one gains :attr:`MIN_GAIN`."""
        fine = super().__call__(layers, num_stages)
        starts = [i for i, (name, _) in enumerate(layers) if i == 0 or layer_of(name) != layer_of(layers[i - 1][0])]
        if len(starts) == len(layers) or len(starts) < num_stages:
            return fine
        prof = self._profiles(layers)
        ends = [*starts[1:], len(layers)]
        whole = balanced_split(
            len(starts), num_stages, lambda s, i, j: self._cost(prof, num_stages, s, starts[i], ends[j - 1])
        )
        coarse = [range(starts[r.start], ends[r.stop - 1]) for r in whole]

        def slowest(ranges: Sequence[range]) -> float:
            return max(self._cost(prof, num_stages, s, r.start, r.stop) for s, r in enumerate(ranges))

        return fine if slowest(fine) < (1 - self.MIN_GAIN) * slowest(coarse) else coarse

    def describe(self, cost: float, stage: int | None = None) -> str:
        if self.measured:
            return f"{cost * 1e3:.2f} ms fwd+bwd per micro-batch, measured"
        return f"{cost / 1e6:.2f} MFLOP fwd+bwd per example, counted"


class MemoryPartitioner(_Balanced):
    """Contiguous stages minimising the largest stage peak: static bytes + the micro-batches of activations the
    schedule holds at once on that stage (+ one block's recomputation under activation checkpointing).

    Args:
        example_input: one micro-batch's input of the body.
        profiles: per-layer profiles already made (models split at their blocks).
        in_flight: micro-batches held at once per stage (``pipeline.activations_in_flight``, counted on the
            schedule's action list); ``None``: 1F1B's ``p - s`` on stage ``s`` of ``p``.
        schedule: the schedule ``in_flight`` was counted for (for the layout print-out).
        checkpointing: the run's activation checkpointing (``checkpointing.checkpoint_every``'s ``"full"``,
            ``"selective"`` or N): a checkpointed block keeps its input per micro-batch in flight (``"selective"``:
            also the outputs of the operations it saves) and its stage also holds, while one such block's backward
            runs, what the recomputation rebuilds (the largest block's).
        all_blocks: every layer is a block (a model split at its block container); else the blocks are an
            ``nn.Sequential`` body's repeated layers (``blocks.sequential_blocks``), as checkpointing picks them.
    """

    kind = "memory"

    def __init__(
        self,
        example_input: Any = None,
        profiles: list[Profile] | None = None,
        in_flight: Sequence[int] | None = None,
        schedule: str = "1f1b",
        checkpointing: int | str | None = None,
        all_blocks: bool = False,
    ) -> None:
        super().__init__(example_input, profiles)
        self.in_flight = list(in_flight) if in_flight is not None else None
        self.schedule = schedule
        self.checkpointing = checkpointing
        self.all_blocks = all_blocks

    def _like(self, example_input: Any, profiles: list[Profile] | None, **changes: Any) -> MemoryPartitioner:
        settings = {
            "in_flight": self.in_flight,
            "schedule": self.schedule,
            "checkpointing": self.checkpointing,
            "all_blocks": self.all_blocks,
        }
        return type(self)(example_input, profiles, **{**settings, **changes})

    def for_schedule(
        self, in_flight: Sequence[int], schedule: str, checkpointing: int | str | None = None
    ) -> MemoryPartitioner:
        """The same partitioner counting ``in_flight[s]`` micro-batches of activations on stage ``s``, with the
        run's activation checkpointing."""
        return self._like(
            self.example_input, self.profiles, in_flight=in_flight, schedule=schedule, checkpointing=checkpointing
        )

    def for_input(self, example_input: Any) -> MemoryPartitioner:
        return self._like(example_input, None)

    def for_blocks(self, module: nn.Module, blocks: Sequence[nn.Module], example_input: Any) -> MemoryPartitioner:
        part = super().for_blocks(module, blocks, example_input)
        return self._like(part.example_input, part.profiles, all_blocks=True)

    def held(self, num_stages: int, s: int) -> int:
        """Micro-batches of activations stage ``s`` holds at once."""
        if self.in_flight is None:
            return num_stages - s
        if len(self.in_flight) != num_stages:
            raise ValueError(
                f"MemoryPartitioner: in-flight counts for {len(self.in_flight)} stages ({self.schedule}) but the "
                f"body is split into {num_stages}."
            )
        return self.in_flight[s]

    def _profiles(self, layers: Sequence[tuple[str, nn.Module]]) -> list[Profile]:
        """Per layer ``(flops, static, bytes held per micro-batch in flight, bytes its recomputation adds)``: a
        checkpointed block holds its input (and, selective, its saved operations' outputs) and rebuilds the rest
        during its backward."""
        prof = super()._profiles(layers)
        chosen: set[str] = set()
        if self.checkpointing is not None:
            blocks = [n for n, _ in layers] if self.all_blocks else [n for n, _ in sequential_blocks(layers)]
            chosen = set(chosen_blocks(blocks, self.checkpointing))
        out: list[Profile] = []
        for (name, _), p in zip(layers, prof):
            if name in chosen:
                kept = p[4] if self.checkpointing == "selective" else p[3]
                out.append((p[0], p[1], kept, max(0.0, p[2] - kept)))
            else:
                out.append((p[0], p[1], p[2], 0.0))
        return out

    def _cost(self, prof: list[Profile], num_stages: int, s: int, i: int, j: int) -> float:
        held = self.held(num_stages, s) * sum(p[2] for p in prof[i:j])
        return sum(p[1] for p in prof[i:j]) + held + max(p[3] for p in prof[i:j])

    def describe(self, cost: float, stage: int | None = None) -> str:
        ckpt = "" if self.checkpointing is None else f", {self.checkpointing} activation checkpointing"
        # the whole layers' figures, before tensor-parallel and FSDP sharding divide a rank's share of them
        peak = f"{cost / 2**20:.2f} MiB peak, unsharded"
        if self.in_flight is None or stage is None:
            return f"{peak}: params, grads, Adam states, 1F1B activations in flight{ckpt}"
        held = self.in_flight[stage]
        return (
            f"{peak}: params, grads, Adam states, activations of {held} micro-batch"
            f"{'es' if held != 1 else ''} in flight under {self.schedule}{ckpt}"
        )
