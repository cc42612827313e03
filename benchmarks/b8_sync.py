"""B8 host synchronisations per training step: what ``ThreeDStrategy`` adds over plain Lightning, counted on CPU.

A host synchronisation is an operation after which the host reads a device value, so the host waits for the device
(on a GPU: the stream drains, the GPU idles until the host queues more work). On CPU nothing waits, but the same
calls are made, so they are counted here without a GPU (:class:`SyncCounter`):

* ``aten::_local_scalar_dense``, seen by a ``TorchDispatchMode``: ``.item()``, ``bool(t)``, ``float(t)``,
  ``int(t)``, ``if t:`` (data-dependent Python branches);
* ``Tensor.tolist()``, ``Tensor.cpu()``, ``Tensor.numpy()`` and ``Tensor.to("cpu")`` (the device written as the
  string ``"cpu"``), seen by a ``TorchFunctionMode``. A ``.to(device)`` with a ``torch.device`` cannot be told from
  a move to the training device on a CPU-only machine and is not counted (the GPU check's
  ``torch.cuda.set_sync_debug_mode`` sees those).

The window of one training step is from ``on_train_batch_start`` to ``on_train_batch_end`` of a callback placed
first (Lightning's ``training_step``, ``zero_grad``, ``backward``, gradient clipping and the optimizer step, all
inside the optimizer-step closure); Lightning's own logging bookkeeping after ``on_train_batch_end`` is outside,
for both sides alike. ``torch.optim``'s own calls (optimizers read their per-parameter step counters, host tensors
unless ``capturable``) are listed but not counted: the same optimizer code runs on both sides. Each counted call is
recorded with a short summary of its Python stack (the innermost frames outside torch), so the record says where
every synchronisation comes from.

Layouts (the tiny example GPT, 2 warm-up steps then 3 counted steps; counts do not depend on the model's size):
``tp1 pp1`` (1 process, m=1), ``tp2 x pp2 x dp2`` (8 processes, 1F1B, m=4; the rank with the most) and one rank with two
interleaved stages (``pp1 stages_per_rank=2``, interleaved 1F1B, m=4). Baseline: plain Lightning
(``strategy="auto"``, 1 process) training the same module on the same batches.

``measured`` = the most synchronisations per step the strategy adds over the baseline (over the layouts; goal
<= 1); ``per_micro_batch`` = the most it adds per micro-batch: the calls made inside a micro-batch's forward or
backward (the schedule's loss function, a stage's forward) beyond what the user's ``training_step`` makes once per
step under plain Lightning, over the micro-batch count (goal 0).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

from .common import Record

ID, TITLE = "B8", "host synchronisations per training step added by ThreeDStrategy (counted on CPU)"

LAYOUTS: dict[str, dict[str, Any]] = {
    "tp1_pp1": {"devices": 1, "tp": 1, "pp": 1, "micro_batches": 1},
    "tp2_pp2_dp2_1f1b_m4": {"devices": 8, "tp": 2, "pp": 2, "micro_batches": 4, "schedule": "1f1b"},
    "one_rank_two_stages_interleaved_m4": {
        "devices": 1,
        "tp": 1,
        "pp": 1,
        "micro_batches": 4,
        "stages_per_rank": 2,
        "schedule": "interleaved1f1b",
    },
}
"""The strategy's layouts (``ThreeDStrategy`` keyword arguments, ``devices`` = processes)."""

WARMUP, STEPS, BATCH = 2, 3, 8

# Frames inside these functions are "inside a micro-batch" (run once per micro-batch by the schedule).
MICRO_BATCH_FRAMES = ("run_stage", "forward_one_chunk", "backward_one_chunk", "_maybe_compute_loss")
MICRO_BATCH_CALLERS = ("StepAdapter.__call__",)


def _stack_summary(depth: int = 4) -> tuple[str, bool, bool]:
    """The innermost ``depth`` frames outside torch and this module, whether a micro-batch frame is among all, and
    whether the call comes from ``torch.optim`` (an optimizer's own step counters)."""
    frame = sys._getframe(2)
    kept: list[str] = []
    in_micro = in_optim = False
    leading = True  # the torch frames between the call and the first frame outside torch
    while frame is not None:
        code = frame.f_code
        path = code.co_filename.replace("\\", "/")
        if leading and not path.endswith("b8_sync.py"):
            if "/torch/" in path:
                in_optim = in_optim or "/torch/optim/" in path
            else:
                leading = False
        name = code.co_qualname if hasattr(code, "co_qualname") else code.co_name
        if code.co_name in MICRO_BATCH_FRAMES or name in MICRO_BATCH_CALLERS:
            in_micro = True
        outside = "/torch/" not in path and not path.endswith("b8_sync.py") and "/contextlib.py" not in path
        if outside and len(kept) < depth:
            short = "/".join(path.split("/")[-2:])
            kept.append(f"{short}:{frame.f_lineno} {name}")
        frame = frame.f_back
    return " <- ".join(kept), in_micro, in_optim


class SyncCounter:
    """Counts host synchronisations while ``active`` (see the module docstring for what counts).

    Use as a context manager around the code to watch (it installs the two modes); ``begin()`` / ``end()`` open
    and close one counted window (a training step). ``steps`` holds one ``Counter`` per window: ``(kind, stack
    summary, inside a micro-batch) -> calls``.
    """

    def __init__(self) -> None:
        self.active = False
        self.steps: list[Counter[tuple[str, str, bool]]] = []
        self._modes: list[Any] = []

    # ------------------------------------------------------------------ windows
    def begin(self) -> None:
        self.steps.append(Counter())
        self.active = True

    def end(self) -> None:
        self.active = False

    def record(self, kind: str) -> None:
        if not self.active or not self.steps:
            return
        self.active = False  # nothing the summary does is counted
        try:
            where, in_micro, in_optim = _stack_summary()
            self.steps[-1][("optimizer " + kind if in_optim else kind, where, in_micro)] += 1
        finally:
            self.active = True

    # ------------------------------------------------------------------ modes
    def __enter__(self) -> SyncCounter:
        import torch
        from torch.overrides import TorchFunctionMode

        from lightning_3d.core.torch_compat import TorchDispatchMode

        counter = self
        scalar = torch.ops.aten._local_scalar_dense.default
        host_methods = {torch.Tensor.tolist: "tolist", torch.Tensor.cpu: "cpu", torch.Tensor.numpy: "numpy"}

        class _Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                if func is scalar:
                    counter.record("item")
                return func(*args, **(kwargs or {}))

        class _Function(TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                kwargs = kwargs or {}
                kind = host_methods.get(func)
                if kind is None and func is torch.Tensor.to and _to_host_string(args, kwargs):
                    kind = "to('cpu')"
                if kind is not None:
                    counter.record(kind)
                return func(*args, **kwargs)

        self._modes = [_Dispatch(), _Function()]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []

    # ------------------------------------------------------------------ results
    def per_step(self, skip: int = 0) -> list[int]:
        """Calls per counted window after the first ``skip`` windows (``torch.optim``'s own not counted)."""
        return [_count(c) for c in self.steps[skip:]]

    def summary(self, skip: int = 0) -> dict[str, Any]:
        """Per-step figures over the windows after ``skip``: the most calls in one step, the most inside
        micro-batches, the optimizer's own (``torch.optim`` reads its per-parameter step counters, which live on
        the host unless ``capturable``: the same optimizer code on both sides, not counted in ``per_step``), and
        every source with its calls per step (the most over the steps)."""
        steps = self.steps[skip:]
        sources: dict[str, int] = {}
        for step in steps:
            per: Counter[str] = Counter()
            for (kind, where, in_micro), n in step.items():
                per[f"{kind}{' [micro-batch]' if in_micro else ''}: {where}"] += n
            for key, n in per.items():
                sources[key] = max(sources.get(key, 0), n)
        return {
            "per_step": max((_count(s) for s in steps), default=0),
            "in_micro_batches_per_step": max((_count(s, micro=True) for s in steps), default=0),
            "optimizer_per_step": max((sum(s.values()) - _count(s) for s in steps), default=0),
            "steps": [_count(s) for s in steps],
            "sources": dict(sorted(sources.items(), key=lambda kv: -kv[1])),
        }


def _count(step: Counter[tuple[str, str, bool]], micro: bool = False) -> int:
    return sum(n for (kind, _, m), n in step.items() if not kind.startswith("optimizer ") and (m or not micro))


def _to_host_string(args: Any, kwargs: dict[str, Any]) -> bool:
    values = [*args[1:], kwargs.get("device")]
    return any(isinstance(v, str) and v.split(":")[0] == "cpu" for v in values)


# ---------------------------------------------------------------------------------------------- workers
def _callback(counter: SyncCounter) -> Any:
    import lightning as L

    class Window(L.Callback):
        def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
            counter.begin()

        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            counter.end()

    return Window()


def worker(layout: str | None, tiny: bool) -> dict[str, Any]:
    """One fit (every rank); returns the counts of the rank with the most. ``layout=None``: plain Lightning."""
    import os

    from .common import model_config

    config = model_config(tiny=True)  # counts do not depend on the model's size
    steps = WARMUP + STEPS
    counter = SyncCounter()
    callback = _callback(counter)
    with counter:
        if layout is None:
            _fit_plain(config, callback, steps)
        else:
            from .common import fit_3d

            kwargs = dict(LAYOUTS[layout])
            devices = kwargs.pop("devices")
            fit_3d(config, callback, batch=BATCH, steps=steps, devices=devices, **kwargs)
    result = counter.summary(skip=WARMUP)
    result["rank"] = int(os.environ.get("RANK", "0"))
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, result)  # the rank with the most synchronisations is reported
        result = max(everyone, key=lambda r: (r["per_step"], r["in_micro_batches_per_step"], -r["rank"]))
        result["per_rank"] = [r["per_step"] for r in everyone]
    return result


def _fit_plain(config: dict[str, Any], callback: Any, steps: int) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from .common import build_gpt, quiet_lightning, token_batch

    quiet_lightning()
    L.seed_everything(0, verbose=False)
    model = build_gpt(config, build=False)
    x, y = token_batch(config, BATCH * steps, seed=1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="auto",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    torch.manual_seed(0)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=BATCH))


def added(layouts: dict[str, dict[str, Any]], baseline: dict[str, Any]) -> tuple[float, float, dict[str, Any]]:
    """``(most added per step, most added per micro-batch, per layout)`` from the counts of each run.

    Added per micro-batch: the calls inside micro-batches beyond the baseline's whole step (the user's
    ``training_step`` runs once per step there), over the micro-batch count.
    """
    rows: dict[str, Any] = {}
    for name, res in layouts.items():
        m = LAYOUTS[name]["micro_batches"] if name in LAYOUTS else res.get("micro_batches", 1)
        per_step = res["per_step"] - baseline["per_step"]
        per_micro = max(0, res["in_micro_batches_per_step"] - baseline["per_step"]) / m
        rows[name] = {"added_per_step": per_step, "added_per_micro_batch": per_micro, "micro_batches": m}
    measured = max((r["added_per_step"] for r in rows.values()), default=0)
    per_micro = max((r["added_per_micro_batch"] for r in rows.values()), default=0.0)
    return measured, per_micro, rows


def run(out: Path, tiny: bool = False) -> Record:
    """Run the baseline and every layout in fresh processes; build the record."""
    from .common import launch

    baseline = launch("b8_sync:worker", 1, {"layout": None, "tiny": tiny}, timeout=300)
    results = {
        name: launch("b8_sync:worker", spec["devices"], {"layout": name, "tiny": tiny}, timeout=400)
        for name, spec in LAYOUTS.items()
    }
    measured, per_micro, rows = added(results, baseline)
    lines = [f"plain Lightning (strategy='auto', 1 process): {baseline['per_step']} per step"]
    for name, res in results.items():
        row = rows[name]
        lines.append(
            f"{name}: {res['per_step']} per step (+{row['added_per_step']}), "
            f"{res['in_micro_batches_per_step']} inside micro-batches (m={row['micro_batches']}: "
            f"+{row['added_per_micro_batch']:.2f} per micro-batch)"
        )
        for source, n in list(res["sources"].items())[:6]:
            lines.append(f"    {n} x {source}")
    lines.append(f"added: {measured} per step (goal <= 1), {per_micro:.2f} per micro-batch (goal 0)")
    details = {
        "baseline": baseline,
        "layouts": {name: {**results[name], **rows[name], "settings": LAYOUTS[name]} for name in results},
        "per_micro_batch": per_micro,
        "window": "on_train_batch_start .. on_train_batch_end (training_step, zero_grad, backward, clipping, "
        "optimizer step)",
        "counted": "aten::_local_scalar_dense (item, bool/float/int of a tensor), Tensor.tolist/.cpu/.numpy, "
        ".to('cpu')",
        "warmup_steps": WARMUP,
        "counted_steps": STEPS,
    }
    unit = "host synchronisations added per step"
    extra = {"per_micro_batch": per_micro}
    return Record(ID, TITLE, measured, baseline["per_step"], 0, None, unit, details, lines, "per step", extra)
