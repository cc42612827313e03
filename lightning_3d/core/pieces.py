"""Cutting one layer of a Sequential body between two pipeline stages, where one tensor crosses.

Whole layers cannot always balance a pipeline: the example GPT at pp = 2 has an embedding (0.6 ms), eight blocks
(10 ms each) and a head with the loss (6 ms), and no split between blocks beats 1.06x the mean stage. A pre-norm
block is two halves, ``x = x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``, and after the first residual add only
``x`` is still needed: a stage boundary there passes one tensor, like a boundary between blocks.

A layer's own ``forward`` is traced with ``torch.fx``, its direct children kept whole (leaves), so only the code of
that one ``forward`` is recorded. A **cut** is a point of the trace after which exactly one value is still read,
with a child that owns parameters on both sides. A layer is never cut when:

* its trace differs between training and evaluation mode (a branch on ``self.training`` would be frozen);
* it reads its own parameters or buffers directly (``get_attr``), takes other than one input, or returns other than
  one value;
* the trace fails (data-dependent control flow), or the pieces, run one after the other on the example's meta
  shapes, do not each return one tensor.

A **piece** is a ``torch.fx.GraphModule`` over the nodes between two cuts. It holds the children it calls under
their names in the layer, so parameter names do not change (``body.5.attn.q_proj.weight`` whichever stage holds
it) and checkpoints stay independent of the layout. A stage holding part of a layer names it ``"5#0-1"`` (pieces
0 up to, not including, 1 of layer ``"5"``); a stage holding every piece names the layer plainly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.func import functional_call

SEPARATOR = "#"


@dataclass(frozen=True)
class Part:
    """Pieces ``start`` up to ``stop`` (exclusive) of body layer ``layer``; ``start = 0, stop = None`` is the whole
    layer."""

    layer: str
    start: int = 0
    stop: int | None = None

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop is None

    def __str__(self) -> str:
        return self.layer if self.whole else f"{self.layer}{SEPARATOR}{self.start}-{self.stop}"


def parse(name: str) -> Part:
    """The :class:`Part` a stage's layer name stands for (``"5"`` or ``"5#0-1"``)."""
    layer, sep, span = name.partition(SEPARATOR)
    if not sep:
        return Part(layer)
    start, _, stop = span.partition("-")
    return Part(layer, int(start), int(stop))


def layer_of(name: str) -> str:
    """The body layer a stage's layer name belongs to (``"5#0-1"`` -> ``"5"``)."""
    return name.partition(SEPARATOR)[0]


class _ChildrenAsLeaves(fx.Tracer):
    """Records one module's own ``forward``: its direct children are called, not traced into."""

    def __init__(self, root: nn.Module) -> None:
        super().__init__()
        self._children = {id(m) for m in root.children()}

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return id(m) in self._children or super().is_leaf_module(m, module_qualified_name)


@dataclass
class Traced:
    """A layer's trace and the node positions after which it may be cut (see the module docstring)."""

    graph: fx.Graph
    cuts: list[int]  # positions in list(graph.nodes): the boundary is after that node

    @property
    def num_pieces(self) -> int:
        return len(self.cuts) + 1


def _trace(layer: nn.Module) -> fx.Graph:
    return _ChildrenAsLeaves(layer).trace(layer)


def trace(layer: nn.Module) -> Traced | None:
    """``layer``'s trace and its cuts, or ``None`` when it cannot or should not be cut (module docstring)."""
    if not any(True for _ in layer.children()):
        return None
    mode = layer.training
    try:
        graphs = []
        for training in (True, False):
            layer.train(training)
            graphs.append(_trace(layer))
    except Exception:  # any failure to trace means: keep the layer whole
        return None
    finally:
        layer.train(mode)
    if graphs[0].python_code("self").src != graphs[1].python_code("self").src:
        return None  # the forward branches on self.training: a trace would freeze one branch
    graph = graphs[0]
    nodes = list(graph.nodes)
    if sum(n.op == "placeholder" for n in nodes) != 1 or any(n.op == "get_attr" for n in nodes):
        return None
    output = nodes[-1]
    if output.op != "output" or len(output.args) != 1 or not isinstance(output.args[0], fx.Node):
        return None
    position = {n: i for i, n in enumerate(nodes)}
    last_use = {n: max((position[u] for u in n.users), default=-1) for n in nodes}
    candidates = []
    for k, node in enumerate(nodes[:-1]):
        if node.op == "placeholder":
            continue
        live = [n for n in nodes[: k + 1] if last_use[n] > k]
        if live == [node] and output.args[0] is not node:
            candidates.append(k)
    # keep only cuts with a child that owns parameters on each side
    owns = [n.op == "call_module" and _has_params(layer.get_submodule(str(n.target))) for n in nodes]
    cuts: list[int] = []
    since = 0  # first position of the current piece
    for k in candidates:
        if any(owns[since : k + 1]):
            cuts.append(k)
            since = k + 1
    while cuts and not any(owns[cuts[-1] + 1 :]):
        cuts.pop()
    return Traced(graph, cuts) if cuts else None


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def piece_module(layer: nn.Module, traced: Traced, start: int, stop: int) -> fx.GraphModule:
    """Pieces ``start .. stop - 1`` of ``layer`` as one module taking and returning one tensor; it calls (and holds,
    under the same names) the layer's children, so it shares their parameters."""
    nodes = list(traced.graph.nodes)
    bounds = [-1, *traced.cuts, len(nodes) - 2]  # piece i: the nodes after bounds[i] up to bounds[i + 1]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    first = nodes[0] if start == 0 else nodes[bounds[start]]
    env[first] = graph.placeholder("x")
    for node in nodes[bounds[start] + 1 : bounds[stop] + 1]:
        if node.op != "placeholder":
            env[node] = graph.node_copy(node, lambda n: env[n])
    result = nodes[-1].args[0] if stop == traced.num_pieces else nodes[bounds[stop]]
    graph.output(env[result])  # type: ignore[index]
    graph.lint()
    return fx.GraphModule(layer, graph, class_name=f"{type(layer).__name__}Piece")


def children_used(module: fx.GraphModule) -> set[str]:
    """The names of the layer's children that a piece calls."""
    return {str(n.target).split(".")[0] for n in module.graph.nodes if n.op == "call_module"}


def cut_layers(
    layers: Sequence[tuple[str, nn.Module]], example: Any = None, keep_whole: Sequence[str] = ()
) -> list[tuple[str, nn.Module]]:
    """``layers`` with every layer that has cuts replaced by its single pieces (``"5#0-1"``, ``"5#1-2"``).

    Args:
        layers: the body's layers, in order (real or meta).
        example: one micro-batch's input of the body; given, the pieces are run one after the other on its meta
            shapes and a layer whose pieces do not each return one tensor of its output's shape is kept whole.
        keep_whole: names of layers never to cut (a tensor-parallel style on the layer itself).
    """
    inputs: list[Any] = [None] * len(layers)
    if example is not None:
        try:
            inputs = meta_inputs(layers, example)
        except Exception:  # no shapes: no check, no cut
            return list(layers)
    out: list[tuple[str, nn.Module]] = []
    for (name, layer), inp in zip(layers, inputs):
        traced = None if name in keep_whole else trace(layer)
        if traced is None:
            out.append((name, layer))
            continue
        parts = [(str(Part(name, i, i + 1)), piece_module(layer, traced, i, i + 1)) for i in range(traced.num_pieces)]
        if example is not None and not _runs_through(layer, [m for _, m in parts], inp):
            out.append((name, layer))
            continue
        out.extend(parts)
    return out


class NotOneTensor(TypeError):
    """A meta pass met a value that is not one tensor where a layer's input was expected."""


def meta_inputs(layers: Sequence[tuple[str, nn.Module]], example: Any) -> list[torch.Tensor]:
    """Each layer's input on the meta device (shape and dtype): ``example`` passed through the layers on meta, no
    compute.

    Raises:
        NotOneTensor: the example, or some layer's input, is not one tensor.
    """
    if not isinstance(example, torch.Tensor):
        raise NotOneTensor(f"the example input is a {type(example).__name__}, not one tensor")
    x, inputs = torch.empty_like(example, device="meta"), []
    with torch.no_grad():
        for name, layer in layers:
            if not isinstance(x, torch.Tensor):
                raise NotOneTensor(f"layer {name!r} takes a {type(x).__name__}, not one tensor")
            inputs.append(x)
            x = meta_call(layer, x)
    return inputs


def _runs_through(layer: nn.Module, parts: Sequence[nn.Module], inp: Any) -> bool:
    """Whether the pieces, chained on ``inp``'s meta shape, pass one tensor each and end at the layer's output."""
    if not isinstance(inp, torch.Tensor):
        return False
    try:
        with torch.no_grad():
            x = torch.empty_like(inp, device="meta")
            whole = meta_call(layer, x)
            for part in parts:
                x = meta_call(part, x)
                if not isinstance(x, torch.Tensor):
                    return False
    except Exception:  # a piece that cannot run on meta is not used
        return False
    return isinstance(whole, torch.Tensor) and tuple(x.shape) == tuple(whole.shape) and x.dtype == whole.dtype


def meta_call(module: nn.Module, x: torch.Tensor) -> Any:
    """``module(x)`` with its parameters and buffers swapped for meta tensors of their shapes (no compute)."""
    state = {n: torch.empty_like(t, device="meta") for n, t in [*module.named_parameters(), *module.named_buffers()]}
    return functional_call(module, state, (x,))


def stage_names(units: Sequence[tuple[str, nn.Module]], ranges: Sequence[range]) -> list[list[str]]:
    """Each stage's layer names from a split of ``units`` (layers and single pieces): a stage's consecutive pieces of
    one layer are merged into one part, and a part holding every piece of its layer is named as the layer."""
    counts: dict[str, int] = {}
    for name, _ in units:
        part = parse(name)
        if not part.whole:
            counts[part.layer] = max(counts.get(part.layer, 0), part.stop or 0)
    stages = []
    for r in ranges:
        names: list[str] = []
        spans: list[Part] = []
        for i in r:
            part = parse(units[i][0])
            if spans and not part.whole and spans[-1].layer == part.layer and not spans[-1].whole:
                spans[-1] = Part(part.layer, spans[-1].start, part.stop)
            else:
                spans.append(part)
        for span in spans:
            full = not span.whole and span.start == 0 and span.stop == counts[span.layer]
            names.append(span.layer if full else str(span))
        stages.append(names)
    return stages


def held_parts(names: Sequence[str]) -> dict[str, list[Part]]:
    """For the layer names of a rank's stages: each layer the rank holds only part of, and its parts."""
    parts: dict[str, list[Part]] = {}
    whole = set()
    for name in names:
        part = parse(name)
        if part.whole:
            whole.add(part.layer)
        else:
            parts.setdefault(part.layer, []).append(part)
    return {layer: p for layer, p in parts.items() if layer not in whole}


def build_parts(body: nn.Module, names: Sequence[str]) -> dict[str, fx.GraphModule]:
    """The piece modules for the parts among ``names`` (layer names of stages), traced from ``body``'s layers."""
    out: dict[str, fx.GraphModule] = {}
    for name in names:
        part = parse(name)
        if part.whole:
            continue
        layer = body.get_submodule(part.layer)
        traced = trace(layer)
        if traced is None or part.stop is None or part.stop > traced.num_pieces:
            raise ValueError(
                f"Stage layer {name!r}: layer {part.layer!r} ({type(layer).__name__}) cannot be cut there "
                f"({'no cut' if traced is None else f'{traced.num_pieces} pieces'})."
            )
        out[name] = piece_module(layer, traced, part.start, part.stop)
    return out


def prune_layer(layer: nn.Module, parts: Sequence[fx.GraphModule]) -> list[str]:
    """Remove from ``layer`` the children none of ``parts`` calls (they are trained on another rank); returns their
    names. The layer's own ``forward`` is not called any more on this rank: its stages call the parts."""
    keep = set().union(*(children_used(p) for p in parts))
    dropped = [n for n, _ in layer.named_children() if n not in keep]
    for n in dropped:
        delattr(layer, n)
    return dropped


def describe(name: str, module: nn.Module | None) -> str:
    """A stage layer's name as the layout shows it: ``5 (ln_1, attn)`` for a part, the name for a whole layer."""
    if parse(name).whole or not isinstance(module, fx.GraphModule):
        return name
    called = [str(n.target) for n in module.graph.nodes if n.op == "call_module"]
    return f"{layer_of(name)} ({', '.join(called)})"
