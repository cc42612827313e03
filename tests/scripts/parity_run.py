"""Train tiny models once per case and record what a parity test compares.

Run as the single-device reference (``--ref``, one process, plain Lightning) or under ThreeDStrategy
(``--tp/--pp/--dp``, Lightning's launcher starts the ranks). Each case writes ``OUT/<case>.pt`` (rank 0):
per-step logged values and returned loss, the global gradient norm before clipping, the first step's
gradients and the final parameters as full tensors; under ThreeDStrategy also per-rank batch hashes,
whether data-parallel replicas are bitwise identical and each rank's parameter element counts.

The 3D run starts from the reference's initial weights (``OUT/<case>.init.pt``), loaded with
``strategy.load_full_state_dict``. Before that, under HSDP (``--hsdp-cases``, models built in ``configure_model``)
each run also records how its own materialisation compares with one process's: the initial parameters gathered
to rank 0 against :func:`lightning_3d.core.materialize.materialize` of the whole model on the meta device with the
same seed (max abs difference), and the peak live tensor bytes of building the stages (``benchmarks/mem_tracker``)
beside the rank's parameter share and the largest layer it holds, whole.

``--rab-cases`` / ``--hsdp-rab-cases`` run more cases in the same launch with ``fsdp_reshard_after_backward=True``
(``OUT/<case>@rab.pt``, ``OUT/<case>@hsdp-rab.pt``); ``--sub-rab-cases`` / ``--hsdp-sub-rab-cases`` more again with
``fsdp_unit="submodule"`` as well (``OUT/<case>@sub-rab.pt`` under ``"fsdp"``, also in a launch whose own cases run
under ``"replicate"``, and ``OUT/<case>@hsdp-sub-rab.pt``); those built in ``configure_model`` also record how their
own materialisation compares with one process's (as the HSDP cases do).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelSummary
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_3d import ThreeDStrategy
from lightning_3d.core import torch_compat, weight_grad_store
from lightning_3d.core.tied import canonical_names

from models import MODELS, CutInsideBlocks, OrderedData
from parity_check import schedule_tags

# name: (model, precision, steps, clip, accumulate, build)
CASES = {
    "mlp64": ("mlp", "64-true", 2, None, 1, "configure"),
    "gpt64": ("gpt", "64-true", 2, None, 1, "configure"),
    "mlp32": ("mlp", "32-true", 20, 0.5, 1, "init"),
    "gpt32": ("gpt", "32-true", 20, 0.5, 1, "configure"),
    "mlp32acc": ("mlp", "32-true", 6, 0.5, 2, "configure"),
    "gptbf": ("gpt", "bf16-mixed", 2, 0.5, 1, "configure"),
    # models that are not one nn.Sequential: split at their block container (tests/test_any_model.py)
    "nano64": ("nano", "64-true", 2, None, 1, "configure"),
    "nano32": ("nano", "32-true", 20, 0.5, 1, "configure"),
    "nanotied64": ("nanotied", "64-true", 2, None, 1, "init"),
    "nanotied32": ("nanotied", "32-true", 20, 0.5, 1, "init"),
    "llama64": ("llama", "64-true", 2, None, 1, "init"),
    "llama32": ("llama", "32-true", 20, 0.5, 1, "init"),
    "llamatied64": ("llamatied", "64-true", 2, None, 1, "init"),  # its embedding's gradient comes back replicated
    "qwen364": ("qwen3", "64-true", 2, None, 1, "init"),
    "gpt264": ("gpt2", "64-true", 2, None, 1, "init"),
    "gpt232": ("gpt2", "32-true", 20, 0.5, 1, "init"),
    # final norm and output projection registered before the blocks, called after them
    "opt64": ("opt", "64-true", 2, None, 1, "init"),
    # no tensor-parallel plan of its own: the automatic one, on the model's dummy_inputs
    "stablelm64": ("stablelm", "64-true", 2, None, 1, "init"),
    "stablelm32": ("stablelm", "32-true", 20, 0.5, 1, "init"),
    # a learned activation inside the tensor-parallel MLP: its gradient summed over tp
    "apertus64": ("apertus", "64-true", 2, None, 1, "init"),
    # blocks called with the rotary tables besides the hidden states (torchtitan / litgpt style)
    "rotary64": ("rotary", "64-true", 2, None, 1, "init"),
    "rotary32": ("rotary", "32-true", 20, 0.5, 1, "init"),
    # no block container: at pp = 1 the whole module is analysed for tensor parallelism
    "plain64": ("plain", "64-true", 2, None, 1, "init"),
    "plain32": ("plain", "32-true", 20, 0.5, 1, "init"),
    # built in configure_model: on the meta device under ThreeDStrategy, materialised per stage with the
    # model's own initialiser (then given the reference's weights)
    "llamameta64": ("llama", "64-true", 2, None, 1, "configure"),
    "gpt2meta64": ("gpt2", "64-true", 2, None, 1, "configure"),
    # the automatic plan's vocabulary-sharded embedding with the head tied to it, materialised stage by stage
    "nanotiedmeta64": ("nanotied", "64-true", 2, None, 1, "configure"),
    # its forward calls each block through torch.utils.checkpoint (non-reentrant): recomputed from what each stage
    # received
    "nanockpt64": ("nanockpt", "64-true", 2, None, 1, "init"),
    # attention set to the rank's heads (num_heads), analysed on the meta device on the model's dummy_inputs
    "optmeta64": ("opt", "64-true", 2, None, 1, "configure"),
    "stablelmmeta64": ("stablelm", "64-true", 2, None, 1, "configure"),
    # its rotary table (a non-persistent buffer) computed again on materialisation, in float64 as Lightning would
    "gptjmeta64": ("gptj", "64-true", 2, None, 1, "configure"),
    # Linear subclasses that compute what nn.Linear does; each key/value group's q, k, v fused in one projection
    "falcon64": ("falcon", "64-true", 2, None, 1, "init"),
    # its own plan names the embedding and the head only: those kept, the blocks analysed
    "hunyuan64": ("hunyuan", "64-true", 2, None, 1, "init"),
    # encoder and vision models: a sequence classifier (pooler and classifier after the blocks); an image classifier
    # whose forward reads the patch embedding's weight dtype on every stage; a masked LM whose forward reads each
    # layer's attention type and returns a tuple per layer, its decoder tied to the embedding
    "bertcls64": ("bertcls", "64-true", 2, None, 1, "init"),
    "vit64": ("vit", "64-true", 2, None, 1, "init"),
    "modernbert64": ("modernbert", "64-true", 2, None, 1, "init"),
    # an image classifier whose pipeline blocks (Swin's stages) return tuples
    "swin64": ("swin", "64-true", 2, None, 1, "init"),
}
COUNTER: CollectiveCounter | None = None
SEQUENTIAL_CASES = ["mlp64", "gpt64", "mlp32", "gpt32", "mlp32acc", "gptbf"]
GLOBAL_BATCH = 16


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def _canonical(module: torch.nn.Module, named: dict[str, Any]) -> dict[str, Any]:
    """A weight tied across stages is held under its other name on the last stage: report it canonically."""
    aliases = canonical_names(module)
    return {aliases.get(n, n): t for n, t in named.items()}


def _gather_named(named: dict[str, torch.Tensor], contribute: bool) -> dict[str, torch.Tensor]:
    if not dist.is_initialized():
        return named
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, named if contribute else {})
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        out.update(part)
    return out


class CollectiveCounter:
    """Counts FSDP2's reduce-scatters and all-gathers (the ``torch.distributed`` functions FSDP2 calls), and the
    all-reduces over one group of ranks (``replica_ranks``: HSDP's replicas of this rank's shard, set per run)."""

    def __init__(self) -> None:
        self.rs, self.ag = torch_compat.fsdp_collective_names()
        self.counts = {self.rs: 0, self.ag: 0, "all_reduce": 0}
        self.replica_ranks: list[int] | None = None
        for name in self.counts:
            real = getattr(dist, name)

            def counted(*args, _real=real, _name=name, **kwargs):
                if _name != "all_reduce" or self._over_replicas(kwargs.get("group")):
                    self.counts[_name] += 1
                return _real(*args, **kwargs)

            setattr(dist, name, counted)

    def _over_replicas(self, group: dist.ProcessGroup | None) -> bool:
        if self.replica_ranks is None or group is None:
            return False
        return sorted(dist.get_process_group_ranks(group)) == self.replica_ranks

    def take(self) -> tuple[int, int, int]:
        """(reduce-scatters, all-gathers, all-reduces over the replicas) since the last call."""
        taken = (self.counts[self.rs], self.counts[self.ag], self.counts["all_reduce"])
        self.counts = dict.fromkeys(self.counts, 0)
        return taken


def replica_ranks(trainer, dp_shard: int) -> list[int]:
    """The global ranks holding the same HSDP shard as this rank (same pp and tp coordinates, dp rank equal modulo
    ``dp_shard``: replicas are the outer half of dp), from the (dp, pp, tp) mesh alone."""
    mesh = trainer.strategy.device_mesh
    table = mesh.mesh  # (dp, pp, tp) -> global rank
    dp, pp, tp = (mesh[d].get_local_rank() for d in ("dp", "pp", "tp"))
    return sorted(int(table[d, pp, tp]) for d in range(table.shape[0]) if d % dp_shard == dp % dp_shard)


class BuildProbe:
    """Peak live tensor bytes while ``build_stages`` runs (materialising and sharding this rank's stages)."""

    def __init__(self) -> None:
        import lightning_3d.strategy as strategy_module
        from benchmarks.mem_tracker import peak_tracker

        self.peak: int | None = None
        real = strategy_module.build_stages

        def measured(*args, **kwargs):
            tracker = peak_tracker()
            with tracker:
                built = real(*args, **kwargs)
            self.peak = tracker.peak
            return built

        strategy_module.build_stages = measured


BUILD_PROBE: BuildProbe | None = None


def _materialisation_record(trainer, pl_module, model_name: str, seed: int) -> dict[str, Any]:
    """This rank's build peak, parameter share and largest module it materialises whole (a layer of its stages, or
    another module holding parameters, counted from the full model's shapes), and (rank 0) the initial parameters'
    max abs difference from one process materialising the whole model (meta device, same seed)."""
    from lightning_3d.core.materialize import materialize

    strategy = trainer.strategy
    share = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in pl_module.parameters()
    )
    plan, pp_rank = strategy.stage_plan, strategy.device_mesh["pp"].get_local_rank()
    layers = [f"{plan.body_fqn}.{k}." for s in range(plan.num_stages) if plan.stage_to_rank[s] == pp_rank
              for k in plan.layer_names[s]]  # fmt: skip
    itemsize = next(pl_module.parameters()).element_size()
    held = {n for n, _ in pl_module.named_parameters()}
    whole: dict[str, int] = {}  # module materialised at once -> its full bytes
    for name, spec in strategy.full_spec.items():
        if spec.is_parameter and name in held:
            owner = next((k for k in layers if name.startswith(k)), name.rsplit(".", 1)[0])
            whole[owner] = whole.get(owner, 0) + itemsize * math.prod(spec.shape)
    full = strategy.full_state_dict()
    diff = None
    if full is not None:
        dtype = next(iter(full.values())).dtype
        with torch.device("meta"):
            ref = MODELS[model_name](build="configure")
            ref.configure_model()
        ref.to(dtype)
        materialize(ref, torch.device("cpu"), seed, prefix="")  # the whole model, as one device would
        want = ref.state_dict()
        diff = float("inf") if set(full) != set(want) else max(float((full[k] - want[k]).abs().max()) for k in want)
    return {
        "build_peak": BUILD_PROBE.peak if BUILD_PROBE is not None else None,
        "param_share_bytes": share,
        "largest_layer_full_bytes": max(whole.values()),
        "init_max_abs_diff": diff,
    }


def _fsdp_units(trainer) -> int:
    """FSDP modules of this rank's stages that manage parameters of their own (not a nested unit's)."""
    count = 0
    for spec in trainer.strategy.runner.runtime.stages:
        units = [m for m in spec.module.modules() if isinstance(m, FSDPModule)]
        for unit in units:
            nested = {id(p) for u in unit.modules() if u is not unit and u in units for p in u.parameters()}
            count += any(id(p) not in nested for p in unit.parameters())
    return count


def _checkpointing(value: str | None) -> str | int | None:
    return int(value) if value is not None and value.isdigit() else value


class SummaryRecorder(ModelSummary):
    """Lightning's model summary of every module, as rank 0 would print it, kept in ``sink["summary"]`` instead
    (compared with one device's by ``parity_check.compare``)."""

    def __init__(self, sink: dict) -> None:
        super().__init__(max_depth=-1, sink=sink)

    @staticmethod
    def summarize(summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                  total_flops, sink, **kwargs) -> None:  # fmt: skip
        sink["summary"] = {
            "columns": [(column, list(values)) for column, values in summary_data],
            "total": total_parameters,
            "trainable": trainable_parameters,
            "size_mb": model_size,
            "modes": dict(total_training_modes),
            "flops": total_flops,
        }


class Recorder(L.Callback):
    def __init__(
        self,
        out: Path,
        case: str,
        ref: bool,
        tag: str = "",
        counter: CollectiveCounter | None = None,
        check_init: bool = False,
        dp_shard: int | None = None,
    ) -> None:
        self.out, self.case, self.ref, self.tag = out, case, ref, tag
        self.rec: dict = {"logged": [], "bar": [], "loss": [], "norm": [], "batches": []}
        self.first_grads = True
        self.counter, self.per_step = counter, []
        self.check_init, self.dp_shard, self.seed = check_init, dp_shard, 0
        self.materialised: dict[str, Any] | None = None

    def setup(self, trainer, pl_module, stage):
        self.seed = torch.initial_seed() % (2**62)  # what the strategy broadcasts from rank 0 (seed=None)

    def _is_writer(self, trainer) -> bool:
        if self.ref:
            return True
        mesh = trainer.strategy.device_mesh
        return mesh["tp"].get_local_rank() == 0 and mesh["dp"].get_local_rank() == 0

    def on_fit_start(self, trainer, pl_module):
        init = self.out / f"{self.case}.init.pt"
        if self.ref:  # (a tied weight is saved under both its names, as Hugging Face's state dicts have it)
            torch.save({k: v.detach().clone() for k, v in pl_module.state_dict().items()}, init)
        else:
            if self.check_init:  # before the reference's weights replace the strategy's own initial ones
                self.materialised = _materialisation_record(trainer, pl_module, CASES[self.case][0], self.seed)
            if self.counter is not None:
                self.counter.replica_ranks = replica_ranks(trainer, self.dp_shard) if self.dp_shard else None
            report = trainer.strategy.load_full_state_dict(torch.load(init))
            assert report.loaded, "nothing loaded"

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        digest = hashlib.sha1(b"".join(t.detach().cpu().numpy().tobytes() for t in batch)).hexdigest()
        self.rec["batches"].append(digest)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.counter is not None:  # (reduce-scatters, all-gathers) since the last optimizer step
            self.per_step.append(self.counter.take())
        if self.ref:
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads)
        else:
            norm = trainer.strategy.grad_norm()
        self.rec["norm"].append(float(norm))
        if self.first_grads:
            self.first_grads = False
            grads = {n: _full(p.grad) for n, p in pl_module.named_parameters() if p.grad is not None}
            self.rec["grads"] = _gather_named(_canonical(pl_module, grads), self._is_writer(trainer))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rec["logged"].append({k: float(v) for k, v in trainer.callback_metrics.items()})
        self.rec["bar"].append({k: float(v) for k, v in trainer.progress_bar_metrics.items()})
        self.rec["loss"].append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module):
        params = {n: _full(p) for n, p in pl_module.named_parameters()}
        self.rec["params"] = _gather_named(_canonical(pl_module, params), self._is_writer(trainer))
        if not self.ref:
            mesh = trainer.strategy.device_mesh
            local = b"".join(
                (p.to_local() if isinstance(p, DTensor) else p).detach().cpu().numpy().tobytes()
                for _, p in sorted(pl_module.named_parameters())
            )
            coords = (mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank(), mesh["tp"].get_local_rank())
            numels = _canonical(
                pl_module,
                {n: (p.to_local() if isinstance(p, DTensor) else p).numel() for n, p in pl_module.named_parameters()},
            )
            mine = {
                "coords": coords,
                "params_sha": hashlib.sha1(local).hexdigest(),
                "batches": self.rec["batches"],
                "numels": numels,
                "collectives": self.per_step,
                "fsdp_units": _fsdp_units(trainer),
                "materialised": self.materialised,
                "deferred_w": weight_grad_store.deferred_passes(),  # split backwards' W from kept linear products
            }
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
            self.rec["ranks"] = ranks
            self.rec["lr"] = [g["lr"] for g in trainer.optimizers[0].param_groups]
        if trainer.global_rank == 0:
            torch.save(self.rec, self.out / f"{self.case}{self.tag}.pt")


# Module names around the blocks of each split model (first stage, last stage) and the blocks' prefix.
AROUND = {
    "nano": (["transformer.wte", "transformer.wpe"], "transformer.h", ["transformer.ln_f", "lm_head"]),
    "llama": (["model.model.embed_tokens"], "model.model.layers", ["model.model.norm", "model.lm_head"]),
    "gpt2": (["model.transformer.wte", "model.transformer.wpe"], "model.transformer.h",
             ["model.transformer.ln_f", "model.lm_head"]),
}  # fmt: skip


def uneven_stages(model_name: str, layers: int = 4) -> list[list[str]]:
    """``stages=`` for pp=2 that the uniform partitioner would not choose: one block on the first stage (with the
    embeddings, named), the others on the last (with the final norm and the head, named)."""
    before, prefix, after = AROUND[model_name.replace("tied", "")]
    blocks = [f"{prefix}.{i}" for i in range(layers)]
    return [[*before, blocks[0]], [*blocks[1:], *after]]


def _hf_forward(self: L.LightningModule, ids: torch.Tensor) -> torch.Tensor:
    return self.model(input_ids=ids, labels=ids).loss


def run_case(args: argparse.Namespace, case: str) -> None:
    model_name, precision, steps, clip, accumulate, build = CASES[case]
    L.seed_everything(1234, verbose=False)
    model = MODELS[model_name](build=build)
    if args.stages:  # also checked at setup on fake tensors (boundary_check.py): give the model an example input
        if not model_name.startswith("nano"):
            model.forward = _hf_forward.__get__(model)
        model.example_input_array = torch.zeros(2, 8, dtype=torch.long)
    if args.ref:
        strategy, devices, batch = "auto", 1, GLOBAL_BATCH
    else:
        world = args.tp * args.pp * args.dp
        strategy = ThreeDStrategy(
            tp=args.tp,
            pp=args.pp,
            micro_batches=args.micro,
            schedule=args.schedule,
            stages_per_rank=args.stages_per_rank,
            stages=uneven_stages(model_name) if args.stages else None,
            partitioner=CutInsideBlocks() if args.partitioner == "inside" else args.partitioner,
            print_layout=args.stages or args.partitioner == "inside",
            data_parallel=args.data_parallel,
            dp_shard=args.dp_shard if args.data_parallel == "hsdp" else None,
            fsdp_reshard_after_backward=True if args.rab else None,
            fsdp_unit=args.fsdp_unit,
            activation_checkpointing=_checkpointing(args.activation_checkpointing),
            compile={"backend": args.compile_backend} if args.compile_backend else False,
        )
        devices, batch = world, GLOBAL_BATCH // args.dp
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        precision=precision,
        max_steps=steps,
        gradient_clip_val=clip,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        callbacks=[
            Recorder(
                Path(args.out),
                case,
                args.ref,
                args.tag,
                COUNTER if args.data_parallel != "replicate" else None,
                # HSDP's (and submodule units') own materialisation of a model built on the meta device, checked
                # before the reference loads
                check_init=build == "configure"
                and ((args.data_parallel == "hsdp" and not args.rab) or args.fsdp_unit == "submodule"),
                dp_shard=args.dp_shard if args.data_parallel == "hsdp" else None,
            )
        ],
    )
    trainer.callbacks.append(SummaryRecorder(trainer.callbacks[-1].rec))
    trainer.fit(model, datamodule=OrderedData(model_name, batch, n=GLOBAL_BATCH * 4))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ref", action="store_true")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--stages-per-rank", type=int, default=1)
    parser.add_argument("--stages", action="store_true", help="pp=2 with stages=uneven_stages(model)")
    parser.add_argument("--partitioner", default="uniform", help="a name, or 'inside': every boundary inside a layer")
    parser.add_argument("--data-parallel", default="replicate", help="replicate, fsdp or hsdp")
    parser.add_argument("--dp-shard", type=int, default=None, help="HSDP's shard size (with --data-parallel hsdp)")
    # HSDP in the same launch: after the other cases, these under data_parallel="hsdp" (OUT/<case>@hsdp.pt)
    parser.add_argument("--hsdp-cases", default="")
    # fsdp_reshard_after_backward=True in the same launch: after the cases (OUT/<case>@rab.pt) and after the HSDP
    # cases (OUT/<case>@hsdp-rab.pt)
    parser.add_argument("--rab-cases", default="")
    parser.add_argument("--hsdp-rab-cases", default="")
    # and with fsdp_unit="submodule" too: OUT/<case>@sub-rab.pt (under fsdp, or --data-parallel's sharded mode),
    # OUT/<case>@hsdp-sub-rab.pt
    parser.add_argument("--sub-rab-cases", default="")
    parser.add_argument("--hsdp-sub-rab-cases", default="")
    parser.add_argument("--fsdp-unit", default="block", help="fsdp_unit of the --cases runs (block or submodule)")
    parser.add_argument("--activation-checkpointing", default=None, help="full, selective or N (default: off)")
    parser.add_argument("--compile-backend", default=None, help="torch.compile each block with this backend")
    parser.add_argument("--cases", default=",".join(SEQUENTIAL_CASES))
    # several schedules in one launch: NAME:STAGES_PER_RANK,...; case C under schedule S writes OUT/C@S.pt
    parser.add_argument("--schedules", default="")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    global COUNTER, BUILD_PROBE
    submodule_cases = args.sub_rab_cases or args.hsdp_sub_rab_cases
    COUNTER = CollectiveCounter() if args.data_parallel != "replicate" or args.hsdp_cases or submodule_cases else None
    BUILD_PROBE = BuildProbe() if args.hsdp_cases or submodule_cases else None
    args.rab = False
    # case C under each schedule writes OUT/C@<tag>.pt (parity_check.schedule_tags: a CSV list by its file's stem, a
    # schedule listed with several stage counts by its stage count too)
    pairs = [(n, int(v)) for n, v in (s.rsplit(":", 1) for s in args.schedules.split(",") if s)]
    runs = [(n, v, f"@{tag}") for (n, v), tag in zip(pairs, schedule_tags(pairs))]
    for schedule, stages_per_rank, tag in runs or [(args.schedule, args.stages_per_rank, "")]:
        args.schedule, args.stages_per_rank, args.tag = schedule, stages_per_rank, tag
        for case in filter(None, args.cases.split(",")):
            run_case(args, case)
    sharded = args.data_parallel if args.data_parallel != "replicate" else "fsdp"
    extra = [
        (args.data_parallel, True, "block", "@rab", args.rab_cases),
        (sharded, True, "submodule", "@sub-rab", args.sub_rab_cases),
        ("hsdp", False, "block", "@hsdp", args.hsdp_cases),
        ("hsdp", True, "block", "@hsdp-rab", args.hsdp_rab_cases),
        ("hsdp", True, "submodule", "@hsdp-sub-rab", args.hsdp_sub_rab_cases),
    ]
    for data_parallel, rab, unit, tag, cases in extra:
        args.data_parallel, args.rab, args.fsdp_unit, args.tag = data_parallel, rab, unit, tag
        for case in filter(None, cases.split(",")):
            run_case(args, case)


if __name__ == "__main__":
    main()
