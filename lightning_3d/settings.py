"""``ThreeDSettings``: every setting of ``ThreeDStrategy``, in one frozen, validated dataclass.

This is the only place a setting is written down. ``ThreeDStrategy(**settings)`` builds one and keeps it as
``strategy.settings``; the consistency check hashes all of its fields (``reliability.settings_items``); the
Hydra schema ``StrategyConfig`` is derived from its fields (``train/config.py``), and a unit test compares
``conf/strategy/3d.yaml`` with them field by field. A new setting is a new field here (with its docstring
entry and its check in ``__post_init__``) plus its line in the YAML file.

Validation runs at construction, in the process that builds the strategy, before any process starts: every
message names the setting and says what would work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .core import partition, torch_compat
from .core.checkpointing import checkpoint_every
from .core.compile import compile_kwargs
from .core.csv_schedule import check_fits, is_csv_schedule, read_csv_schedule
from .core.fsdp import FSDP_UNITS
from .core.loss_weights import LOSS_WEIGHTINGS
from .core.pipeline import (
    ONE_STAGE_PER_RANK_TOO,
    check_schedule_name,
    is_multi_stage,
    is_v_schedule,
    micro_batch_problem,
    min_micro_batches,
    splits_backward,
)
from .core.topology import hsdp_problem
from .core.weight_grad_store import SPLIT_BACKWARDS

NONFINITE_MODES = ("raise", "skip", "off")
DATA_PARALLEL_MODES = ("replicate", "fsdp", "hsdp")
GRAD_REDUCE_DTYPES = ("bf16", "fp16")
TIMEOUT_FIELDS = ("timeout", "train_timeout")


def as_timedelta(value: timedelta | float | None) -> timedelta | None:
    """Seconds or a ``timedelta`` as a ``timedelta`` (``None`` stays ``None``)."""
    return timedelta(seconds=value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


@dataclass(frozen=True)
class ThreeDSettings:
    """The settings of a ``ThreeDStrategy`` (its keyword arguments), validated and normalised.

    After construction ``micro_batches`` holds the count in use (never ``None``), the timeouts are ``timedelta``
    (or ``None``), ``tp_plan`` is a plain ``dict`` copy (``None`` when empty) and ``partitioner`` is kept as given
    (a name or a callable; ``partition.get_partitioner`` makes the object).

    Args:
        tp: tensor-parallel degree: each layer's matrices are split over ``tp`` ranks (Megatron layout).
        pp: pipeline-parallel degree: the body's layers are split into ``pp`` stages.
        dp: data-parallel degree; ``None`` infers ``world_size // (tp * pp)``.
        micro_batches: micro-batches per batch (per data-parallel replica); ``None`` means the fewest the
            schedule accepts (``pp`` for 1F1B, 1 for GPipe). More micro-batches shrink the pipeline bubble
            ``(pp - 1) / (m + pp - 1)``.
        schedule: ``"1f1b"`` (default), ``"gpipe"`` or ``"interleavedzerobubble"`` (1F1B with each backward
            split into an input-gradient and a deferred weight-gradient action, ZB-H1); with
            ``stages_per_rank > 1`` a multi-stage schedule: ``"interleaved1f1b"``, ``"loopedbfs"``,
            ``"interleavedzerobubble"``, or a V schedule
            (``"zbvzerobubble"``, ``"dualpipev"``: exactly ``stages_per_rank=2``, ``micro_batches >= 2 * pp``);
            or the path of a CSV action list (``"path/actions.csv"``, torch's compute-only format: one row per pp
            rank, cells such as ``0F1``, ``1B0``, ``0I2``, ``0W2``; it fixes the stage placement, and
            ``stages_per_rank`` and ``micro_batches`` must match it; ``micro_batches=None`` takes its count).
        stages_per_rank: pipeline stages per rank (virtual stages for interleaved schedules).
        tp_plan: explicit tensor-parallel plan ``{"glob pattern of module name": "colwise" | "rowwise" |
            "colwise_gather" | "vocab" | "sequence" | "replicate" | ParallelStyle}``; it overrides the automatic
            plan for the modules it matches (in a model split at its blocks: modules in the blocks, or outside
            them such as ``"lm_head"``). A ``tp_plan`` attribute on the LightningModule works the same.
        tp_autoplan: find the plan for standard blocks automatically from the data flow (and, with an
            ``example_input_array``, for the embeddings and the head outside a split model's blocks).
        partitioner: ``"uniform"`` (layers per stage), ``"parameters"`` (parameters per stage, the end stages'
            modules outside the blocks counted), ``"compute"`` (minimise the slowest
            stage's forward + backward time, each layer timed at setup on the module's ``example_input_array``
            shape; FLOPs counted on the meta device when timing is impossible),
            ``"memory"`` (minimise the largest stage peak: parameters, gradients, Adam states and the activations
            the schedule keeps in flight on the stage) or a callable; ``"compute"`` and ``"memory"`` need the
            module's ``example_input_array``.
        body: dotted name of an ``nn.Sequential`` body (the earlier contract) when the module has several.
        blocks: dotted name of the block container (``nn.ModuleList`` / ``nn.ModuleDict`` / ``nn.Sequential``) that
            pipeline parallelism splits; ``None`` finds it (a Hugging Face model's ``base_model_pp_plan``, else the
            container holding most parameters).
        seed: seed for initialising layers built in ``configure_model``; ``None`` takes rank 0's
            ``torch.initial_seed()`` (set by ``seed_everything``).
        timeout: timeout of the process groups during setup (the first collectives wait for every rank to import,
            build and materialise its part of the model) and the first training step; seconds or a timedelta.
        train_timeout: timeout of every process group (and of pipeline sends and receives) once the first training
            step has finished: a rank that stops answering fails the others this soon. ``None`` keeps ``timeout``.
        on_nonfinite: a NaN or inf in the loss or in any gradient: ``"raise"`` (every rank raises
            ``NonFiniteError`` at the same step, before the optimizer steps), ``"skip"`` (every rank drops that
            optimizer step's gradients; the global step and LR schedulers still advance) or ``"off"``. The check
            reads every gradient once and the host once per step, before the optimizer step (on an H200 at 1.21B
            parameters: 1.6 ms for the scan, 4-5 ms in all, about 3% of the step).
        check_consistency: compare a hash of the settings and the model structure across ranks at setup, and of the
            first batch of training and of each evaluation hook within each data-parallel replica.
        fail_fast: when one rank fails, stop every rank within about a second (see ``tools/failure_watch.py``).
        process_group_backend: ``"gloo"`` / ``"nccl"``; ``None`` chooses by device.
        print_layout: rank 0 prints the mesh, the stages and the tensor-parallel plan once.
        stages: the modules of each pipeline stage, one list of names per stage (``pp * stages_per_rank`` lists):
            the blocks by their names in the LightningModule (``"model.model.layers.3"``), contiguous and in
            order, and optionally modules with parameters around the blocks (embeddings, final norm, head) to put
            them on another stage than the default (the first stage before the blocks, the last after them).
            Replaces the ``partitioner``; ``None`` lets the partitioner split the blocks. Kept as a tuple of tuples.
        compile: ``torch.compile`` each block (after tensor parallelism, before data parallelism), as torchtitan
            does: ``False`` (default), ``True`` (torch's defaults: inductor) or a mapping of ``torch.compile``
            arguments (``{"backend": "aot_eager"}``, ``{"mode": "max-autotune"}``; keys ``backend``, ``mode``,
            ``fullgraph``, ``dynamic``, ``options``), kept as a plain ``dict``.
        activation_checkpointing: recompute blocks' activations in the backward instead of keeping them (after
            tensor parallelism, per block of the pipeline split, see ``core/checkpointing.py``): ``None`` or
            ``False`` (default: off), ``"full"`` (every block), ``"selective"`` (every block, keeping the outputs
            of matrix multiplications, attention and tensor-parallel collectives) or an integer N (every N-th block
            of the model; 1 is kept as ``"full"``). With ``compile``, ``"full"`` or N: the checkpoint wraps each
            compiled block (``"selective"`` is refused there).
        data_parallel: how the dp ranks hold the model: ``"replicate"`` (default: every dp rank holds its stage's
            parameters, gradients and optimizer states whole, gradients all-reduced once per optimizer step) or
            ``"fsdp"`` (FSDP2 ``fully_shard`` over the dp dimension: parameters, gradients and optimizer states
            sharded over dp, one reduce-scatter per optimizer step; needs dp > 1) or ``"hsdp"`` (hybrid: FSDP2
            over a (dp_replicate, dp_shard) split of dp: sharded over ``dp_shard`` ranks, replicated over the
            ``dp // dp_shard`` groups of them; one reduce-scatter within a shard group and one all-reduce across
            the replicas per optimizer step). See ``core/fsdp.py``.
        dp_shard: ``data_parallel="hsdp"`` only: the ranks each parameter is sharded over, a divisor of dp with
            ``1 < dp_shard < dp``; ``None`` (default) takes the data-parallel ranks of one node (``dp //
            num_nodes``: shard within a node, replicate across nodes), which needs a job of several nodes.
        grad_reduce_dtype: the dtype gradients cross the data-parallel wire in (gradient compression):
            ``"bf16"`` or ``"fp16"`` halve the bytes of the all-reduce (``replicate``) or reduce-scatter (``fsdp``)
            of fp32 gradients; ``None`` (default) keeps today's: the gradients' own dtype (fp32 under
            ``bf16-mixed`` FSDP). Gradients land back in the parameters' dtype (the optimizer sees fp32), and
            ``fp16`` divides by about sqrt(dp) before and after the sum, so its range holds; an overflow becomes
            inf, which ``on_nonfinite`` sees as usual. Needs dp > 1. See ``core/data_parallel.py``.
        fsdp_reshard_after_forward: under ``data_parallel="fsdp"`` or ``"hsdp"``, whether each FSDP unit frees its
            gathered parameters after its forward. ``None`` (default): ``True`` with
            ``fsdp_reshard_after_backward=True``; otherwise ``False`` under a pipeline (one all-gather per unit per
            step instead of two per micro-batch; torch keeps the units gathered through the backward anyway, so
            resharding saves little memory, measured in the README's B4/FSDP part) and torch's own choice at pp = 1
            (blocks reshard, the stage's root unit not). ``True`` or ``False`` forces it for every unit. Kept as
            resolved under ``fsdp_reshard_after_backward=True`` (``True``).
        fsdp_reshard_after_backward: under ``data_parallel="fsdp"`` or ``"hsdp"``, ZeRO-3 as DeepSpeed runs it under
            gradient accumulation: ``True`` reshards each FSDP unit after every micro-batch's backward and
            reduce-scatters its gradients there (the sharded gradients accumulate over micro-batches and over
            ``accumulate_grad_batches`` batches), so a rank holds one unit gathered, with its unsharded gradients,
            at a time (and FSDP2's reduce-scatter input of the unit before): the step's peak is the share plus
            3 / tp blocks and activations (tp2 x pp2 x dp2: share + 1.5 blocks, against 1.8 by default), at the
            price of ``m`` reduce-scatters and ``2m`` all-gathers per unit and batch instead of 1 and 1 (``m``
            micro-batches per batch); HSDP's all-reduce across replicas stays once per optimizer step. Implies
            ``fsdp_reshard_after_forward=True`` (``False`` with it is refused) and turns FSDP2's implicit backward
            prefetch off. Not with schedules that split the backward (``"interleavedzerobubble"``,
            ``"zbvzerobubble"``, ``"dualpipev"``, CSV lists with ``I``/``W`` actions). ``None`` (default) or
            ``False``: torch's pipelined FSDP, each unit gathered from its first forward or backward of the step to
            the step's one reduce-scatter. At pp = 1 the same choice: torch's ``PipelineStage`` keeps every unit
            gathered from its backward to the end of the batch there too, so ``True`` is the ZeRO-3 peak at pp = 1
            (measured with the example GPT at pp1 x dp2, ``micro_batches=1``: the same all-gathers and reduce-scatters
            per step, 25% less peak memory). See ``core/fsdp.py``.
        fsdp_unit: under ``data_parallel="fsdp"`` or ``"hsdp"``, what one FSDP unit (one all-gather and one
            reduce-scatter) holds: ``"block"`` (default: each block the stage holds, then the stage's root with the
            embeddings, final norm and head) or ``"submodule"`` (inside each block, every submodule that directly
            owns parameters, a ``Linear``, ``Embedding``, ``LayerNorm``..., is its own unit, as DeepSpeed's ZeRO-3
            gathers per submodule; then the block, for what is left, then the root as with ``"block"``). A
            submodule whose parameter is shared with a module outside it (a tied weight), or registered twice,
            stays with the unit above, by the rule of ``replicate``'s gradient buckets. With
            ``fsdp_reshard_after_backward=True`` the step's peak is then the share plus three of the largest unit
            (the one gathered, its gradients, FSDP2's reduce-scatter input of the unit before) and activations,
            instead of three blocks / tp (the README's B4/FSDP part, tp2 x pp2 x dp2 at width 1024: share + 0.56
            blocks against 1.52, the issue's "share + one layer" met), at the price of more and smaller
            collectives: each unit's count per step is that of a block unit, and there are as many units as
            parameter-owning submodules (8 per transformer block instead of 1). Alone (without
            ``fsdp_reshard_after_backward``) it lowers no step peak under a pipeline, where every unit stays
            gathered through the step. Combines with activation checkpointing (whose recomputation gathers a
            block's units at once) and ``compile`` (a compiled block breaks into a piece per unit). Parameter names
            and checkpoints do not change. Refused with ``data_parallel="replicate"``. See ``core/fsdp.py``.
        loss_weighting: what each micro-batch's (and data-parallel replica's) mean loss counts for in the batch's:
            ``"samples"`` (its share of the batch's samples), ``"labels"`` (its share of the batch's label tokens,
            ``labels != -100`` in a mapping batch; ``"shifted_labels"``: of ``labels[..., 1:]``, a causal LM's
            targets) or ``"auto"`` (default: label tokens, shifted as Hugging Face's Trainer decides, for a module
            holding a Hugging Face model whose loss is a mean over them: a causal or masked LM, a token classifier;
            samples otherwise). With label tokens
            the gradients and the logged loss are one device's token mean over the whole batch, however the
            labels are padded or masked. See ``core/loss_weights.py``.
        split_backward: how schedules that split each backward into an input-gradient action ``I`` and a later
            weight-gradient action ``W`` (``"interleavedzerobubble"``, the V schedules, CSV lists with ``I``/``W``)
            split it: ``"linear"`` (default) runs ``I`` as the whole backward except the ``nn.Linear`` layers'
            weight gradients, which ``W`` computes from the kept inputs and output gradients (no autograd graph
            walk or per-group ``autograd.grad`` on each micro-batch); ``"autograd"`` keeps torch's graph split.
            Tensor-parallel layers keep their products on their shards; compiled blocks and the first stage take
            torch's split either way. Gradients are the same; ignored by the other schedules. See
            ``core/weight_grad_store.py``.
    """

    tp: int = 1
    pp: int = 1
    dp: int | None = None
    micro_batches: int | None = None
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    tp_plan: Mapping[str, Any] | None = None
    tp_autoplan: bool = True
    partitioner: str | partition.Partitioner = "uniform"
    body: str | None = None
    blocks: str | None = None
    seed: int | None = None
    timeout: timedelta | float | None = timedelta(minutes=30)
    train_timeout: timedelta | float | None = timedelta(minutes=10)
    on_nonfinite: str = "raise"
    check_consistency: bool = True
    fail_fast: bool = True
    process_group_backend: str | None = None
    print_layout: bool = True
    stages: Sequence[Sequence[str]] | None = None
    compile: bool | Mapping[str, Any] = False
    activation_checkpointing: str | int | bool | None = None
    data_parallel: str = "replicate"
    dp_shard: int | None = None
    grad_reduce_dtype: str | None = None
    fsdp_reshard_after_forward: bool | None = None
    fsdp_reshard_after_backward: bool | None = None
    fsdp_unit: str = "block"
    loss_weighting: str = "auto"
    split_backward: str = "linear"

    def __post_init__(self) -> None:
        for name in ("tp", "pp"):  # the same messages as Topology's, which checks them again with the world size
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"ThreeDStrategy: {name} must be a positive integer, got {getattr(self, name)!r}.")
        if self.dp is not None and (not _is_int(self.dp) or self.dp < 1):
            raise ValueError(f"ThreeDStrategy: dp must be a positive integer or None, got {self.dp!r}.")
        _check_at_least_one("stages_per_rank", self.stages_per_rank)
        self._check_schedule()
        minimum = self.min_micro_batches
        if self.micro_batches is None:
            object.__setattr__(self, "micro_batches", max(1, minimum))
        else:
            self._check_micro_batches(self.micro_batches, minimum)
        if self.tp_plan is not None:
            if not isinstance(self.tp_plan, Mapping):
                raise ValueError(
                    f"ThreeDStrategy: tp_plan must be a mapping of module-name patterns to styles or None, got "
                    f"{self.tp_plan!r}."
                )
            # An empty plan gives no entries: the same as none (the command line's default is {}, which Hydra
            # can add entries to; it cannot to null).
            object.__setattr__(self, "tp_plan", dict(self.tp_plan) or None)
        partition.get_partitioner(self.partitioner)  # unknown names fail here, with the list of names
        if self.on_nonfinite not in NONFINITE_MODES:
            raise ValueError(
                f"ThreeDStrategy: on_nonfinite must be one of {NONFINITE_MODES}, got {self.on_nonfinite!r}."
            )
        if self.loss_weighting not in LOSS_WEIGHTINGS:
            raise ValueError(
                f"ThreeDStrategy: loss_weighting must be one of {LOSS_WEIGHTINGS}, got {self.loss_weighting!r}."
            )
        if self.split_backward not in SPLIT_BACKWARDS:
            raise ValueError(
                f"ThreeDStrategy: split_backward must be one of {SPLIT_BACKWARDS}, got {self.split_backward!r}."
            )
        for name in TIMEOUT_FIELDS:
            object.__setattr__(self, name, _check_timeout(name, getattr(self, name)))
        kwargs = compile_kwargs(self.compile)  # unknown keys and wrong types fail here, naming what works
        if not isinstance(self.compile, bool):
            object.__setattr__(self, "compile", kwargs)
        self._check_stages()
        object.__setattr__(self, "activation_checkpointing", checkpoint_every(self.activation_checkpointing))
        if self.activation_checkpointing == "selective" and self.compile is not False:
            raise ValueError(
                "ThreeDStrategy: activation_checkpointing='selective' with compile: the checkpoint runs around each "
                "compiled block, where torch's selective policy cannot see the operations inside the compiled code. "
                "Use activation_checkpointing='full' or N with compile (each checkpointed block is recomputed by "
                "its compiled forward), or compile=False."
            )
        problem = torch_compat.compiled_split_backward_problem()
        if self.compile is not False and problem is not None and self.splits_backward():
            raise ValueError(
                f"ThreeDStrategy: compile with schedule={self.schedule!r}, which runs each backward in two passes: "
                f"{problem}. Upgrade torch, set compile=False, or use a schedule with whole backwards ('1f1b', "
                "'gpipe', 'interleaved1f1b', 'loopedbfs')."
            )
        if self.activation_checkpointing == "selective" and self.splits_backward():
            raise ValueError(
                f"ThreeDStrategy: activation_checkpointing='selective' with schedule={self.schedule!r}, which runs "
                "each backward in two passes (input gradients, then weight gradients): torch's selective "
                "checkpointing hands each kept activation to one backward pass only. Use "
                "activation_checkpointing='full' or N (recomputed in each pass), or a schedule with whole "
                "backwards ('1f1b', 'gpipe', 'interleaved1f1b', 'loopedbfs')."
            )
        if self.data_parallel not in DATA_PARALLEL_MODES:
            raise ValueError(
                f"ThreeDStrategy: data_parallel must be one of {DATA_PARALLEL_MODES}, got {self.data_parallel!r}."
            )
        if self.data_parallel == "fsdp" and self.dp == 1:
            raise ValueError(
                "ThreeDStrategy(data_parallel='fsdp') shards over the data-parallel ranks, but dp=1: there is "
                "nothing to shard over. Use data_parallel='replicate' at dp=1, or more processes (dp = world // "
                "(tp * pp) > 1)."
            )
        self._check_dp_shard()
        self._check_grad_reduce_dtype()
        self._check_fsdp_resharding()
        self._check_fsdp_unit()

    def _check_fsdp_unit(self) -> None:
        if self.fsdp_unit not in FSDP_UNITS:
            raise ValueError(
                f"ThreeDStrategy: fsdp_unit must be one of {FSDP_UNITS} (what one FSDP unit holds: a block, or each "
                f"parameter-owning submodule of a block), got {self.fsdp_unit!r}."
            )
        if self.fsdp_unit == "block":
            return
        if self.data_parallel not in ("fsdp", "hsdp"):
            raise ValueError(
                f"ThreeDStrategy: fsdp_unit={self.fsdp_unit!r} applies to data_parallel='fsdp' or 'hsdp' only, but "
                f"data_parallel={self.data_parallel!r}: replicate gathers no parameters (every dp rank holds them "
                "whole), so there is no FSDP unit to split. Leave fsdp_unit='block', or set data_parallel='fsdp' "
                "(or 'hsdp')."
            )

    def _check_fsdp_resharding(self) -> None:
        for name in ("fsdp_reshard_after_forward", "fsdp_reshard_after_backward"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"ThreeDStrategy: {name} must be True, False or None, got {value!r}.")
            if value is not None and self.data_parallel not in ("fsdp", "hsdp"):
                fix = "set data_parallel='fsdp' (or 'hsdp')"
                if name == "fsdp_reshard_after_backward" and value:
                    fix = (
                        "set data_parallel='fsdp' (or 'hsdp'): replicate holds whole gradients and all-reduces "
                        "them once per optimizer step, there is nothing to reshard"
                    )
                raise ValueError(
                    f"ThreeDStrategy: {name}={value!r} applies to data_parallel='fsdp' or 'hsdp' only, but "
                    f"data_parallel={self.data_parallel!r}. Leave it None, or {fix}."
                )
        if not self.fsdp_reshard_after_backward:
            return
        if self.fsdp_reshard_after_forward is False:
            raise ValueError(
                "ThreeDStrategy: fsdp_reshard_after_backward=True with fsdp_reshard_after_forward=False: each unit "
                "would stay gathered from its forward to its backward, every unit of the stage at once under a "
                "pipeline, which is the memory fsdp_reshard_after_backward is there to save. Leave "
                "fsdp_reshard_after_forward None (it becomes True), or drop fsdp_reshard_after_backward."
            )
        if self.splits_backward():
            raise ValueError(
                f"ThreeDStrategy: fsdp_reshard_after_backward=True with schedule={self.schedule!r}, which splits each "
                "backward into an input-gradient and a later weight-gradient action: FSDP2's post-backward (reshard "
                "and reduce-scatter) runs after the input gradients, before the weight gradients exist. Use a "
                "schedule with full backwards ('1f1b', 'gpipe', 'interleaved1f1b', 'loopedbfs'), or leave "
                "fsdp_reshard_after_backward None."
            )
        object.__setattr__(self, "fsdp_reshard_after_forward", True)

    def splits_backward(self) -> bool:
        """Whether the schedule runs each backward as an input-gradient and a later weight-gradient action."""
        return splits_backward(self.schedule)

    def defers_linear_weight_grads(self) -> bool:
        """Whether the split backward keeps the linear layers' weight gradients for ``W`` (``split_backward``)."""
        return self.splits_backward() and self.split_backward == "linear"

    def _check_dp_shard(self) -> None:
        if self.dp_shard is not None:
            _check_at_least_one("dp_shard", self.dp_shard)
            if self.data_parallel != "hsdp":
                raise ValueError(
                    f"ThreeDStrategy: dp_shard={self.dp_shard} is the shard size of data_parallel='hsdp', but "
                    f"data_parallel={self.data_parallel!r}. Use data_parallel='hsdp', or leave dp_shard None."
                )
        # dp given: check it now (dp_shard=None is resolved, and dp inferred is checked, when the trainer is built)
        if self.data_parallel == "hsdp" and self.dp is not None and (self.dp == 1 or self.dp_shard is not None):
            problem = hsdp_problem(self.dp, self.dp_shard or 1)  # dp=1 is reported whatever dp_shard is
            if problem is not None:
                raise ValueError(problem)

    def _check_grad_reduce_dtype(self) -> None:
        if self.grad_reduce_dtype is None:
            return
        if self.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
            raise ValueError(
                f"ThreeDStrategy: grad_reduce_dtype must be one of {GRAD_REDUCE_DTYPES} or None (the gradients' own "
                f"dtype), got {self.grad_reduce_dtype!r}."
            )
        if self.dp == 1:
            raise ValueError(grad_reduce_dp1_message(self.grad_reduce_dtype, "dp=1"))

    def _check_stages(self) -> None:
        if self.stages is None:
            return
        stages = self.stages
        if (
            isinstance(stages, (str, bytes))
            or not isinstance(stages, Sequence)
            or any(
                isinstance(names, (str, bytes))
                or not isinstance(names, Sequence)
                or not all(isinstance(n, str) for n in names)
                for names in stages
            )
        ):
            raise ValueError(
                "ThreeDStrategy: stages must be a list of lists of module names, one list per pipeline stage, e.g. "
                f"[['model.embed', 'model.layers.0'], ['model.layers.1', 'model.head']]; got {stages!r}."
            )
        num_stages = self.pp * self.stages_per_rank
        if len(stages) != num_stages:
            raise ValueError(
                f"ThreeDStrategy: stages has {len(stages)} lists but pp * stages_per_rank = {self.pp} * "
                f"{self.stages_per_rank} = {num_stages} pipeline stages: give one list of module names per stage."
            )
        if self.body is not None:
            raise ValueError(
                "ThreeDStrategy: stages and body cannot be combined: stages names the blocks of a block container "
                "(blocks=), body selects the nn.Sequential contract."
            )
        if self.partitioner != "uniform":
            raise ValueError(
                f"ThreeDStrategy: stages and partitioner={self.partitioner!r} cannot be combined: stages already "
                "decides which blocks each stage holds."
            )
        object.__setattr__(self, "stages", tuple(tuple(names) for names in stages))

    def _check_schedule(self) -> None:
        check_schedule_name(self.schedule)  # unknown names fail here, with torch's list and the runnable ones
        if is_csv_schedule(self.schedule):  # the action list fixes pp, the stages per rank and their placement
            check_fits(read_csv_schedule(self.schedule), self.pp, self.stages_per_rank)
            return
        multi = is_multi_stage(self.schedule)
        if is_v_schedule(self.schedule) and self.stages_per_rank != 2:
            raise ValueError(
                f"ThreeDStrategy(schedule={self.schedule!r}) places exactly two stages per rank in a V (stage i and "
                f"stage 2*pp-1-i on pp rank i); got stages_per_rank={self.stages_per_rank}. Use stages_per_rank=2."
            )
        if self.stages_per_rank > 1 and not multi:
            raise ValueError(
                f"ThreeDStrategy(schedule={self.schedule!r}) runs one stage per rank; with "
                f"stages_per_rank={self.stages_per_rank} use a multi-stage schedule such as 'interleaved1f1b'."
            )
        if self.stages_per_rank == 1 and multi and self.schedule.lower() not in ONE_STAGE_PER_RANK_TOO:
            raise ValueError(
                f"ThreeDStrategy(schedule={self.schedule!r}) needs stages_per_rank >= 2 (with one stage per rank, "
                "'interleavedzerobubble' splits 1F1B's backwards to fill its bubble)."
            )

    def _check_micro_batches(self, m: Any, minimum: int) -> None:
        _check_at_least_one("micro_batches", m)
        problem = micro_batch_problem(self.schedule, self.pp, m)
        if problem is None:
            return
        if m >= minimum:  # enough, but not in whole rounds (interleaved schedules)
            rounds = [
                c
                for c in range(minimum, 4 * max(m, minimum) + 1)
                if micro_batch_problem(self.schedule, self.pp, c) is None
            ]
            near = sorted(rounds, key=lambda c: (abs(c - m), c))[:2]
            raise ValueError(
                f"ThreeDStrategy: {problem}. Use e.g. micro_batches={' or '.join(map(str, sorted(near)))}."
            )
        # Only schedules that keep micro-batches of every stage in flight have a minimum above 1. GPipe is the way
        # out at one stage per rank (ZB-H1 included); it runs no more than one, and a CSV list fixes its own count.
        fixed = self.stages_per_rank > 1 or is_csv_schedule(self.schedule)
        alternative = "" if fixed else ", or schedule='gpipe' (any count, a larger bubble)"
        raise ValueError(
            f"ThreeDStrategy: {problem}. Use micro_batches >= {minimum} (more shrinks the bubble){alternative}."
        )

    @property
    def min_micro_batches(self) -> int:
        """The fewest micro-batches the schedule accepts at this ``pp`` (1 for GPipe)."""
        return min_micro_batches(self.schedule, self.pp)


def grad_reduce_dp1_message(dtype: str, dp_text: str) -> str:
    """The refusal of ``grad_reduce_dtype`` without data parallelism (``dp_text`` says how dp came to be 1)."""
    return (
        f"ThreeDStrategy(grad_reduce_dtype={dtype!r}) sets the dtype of the data-parallel gradient reduction, but "
        f"{dp_text}: no gradient is reduced over data-parallel ranks, so there is nothing to compress. Leave "
        "grad_reduce_dtype=None at dp=1, or use more processes (dp = world // (tp * pp) > 1)."
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_at_least_one(name: str, value: Any) -> None:
    if not _is_int(value):
        raise ValueError(f"ThreeDStrategy: {name} must be an integer, got {value!r}.")
    if value < 1:
        raise ValueError(f"ThreeDStrategy: {name} must be >= 1, got {value}.")


def _check_timeout(name: str, value: Any) -> timedelta | None:
    converted = as_timedelta(value)
    if converted is None:
        return None
    if not isinstance(converted, timedelta) or converted <= timedelta(0):
        raise ValueError(
            f"ThreeDStrategy: {name} must be a positive number of seconds, a datetime.timedelta or None, got {value!r}."
        )
    return converted
