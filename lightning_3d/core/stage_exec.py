"""Running a model's own forward, and the user's unchanged step, on every pipeline stage.

A stage of a model split at its block container (``blocks.py``) is not a module that can be called on its own:
the blocks need what the model's forward computes around them (attention masks, position ids, rotary tables).
So every stage runs the user's ``training_step`` (or evaluation step) itself, on its micro-batch of the batch
(every rank of a data-parallel replica reads the same batch), with the model arranged for that stage:

* modules held by other stages are stood in for (``stand_ins.py``): a block by a ``Skipped`` (returns what the block
  would, in structure, with its first argument flowing through), a module before the blocks by an ``Elsewhere``
  (returns zeros shaped like the stage's input: its output is never used), a module after the blocks by an
  ``Elsewhere`` that raises if it is ever reached; their attributes read as the real modules' would;
* on a later stage, a forward pre-hook on the stage's blocks replaces the first tensor argument (the tensor flowing
  through the container) of the first one called by the activation received from the previous stage;
* on an earlier stage, a forward hook on the stage's last block stops the step (``_StageDone``) and the block's
  output tensor becomes the stage's output, sent to the next stage, followed by the module outputs later stages
  read (``carry.py``: an encoder's output, a position bias), which the stand-ins of those modules return there;
* blocks the model skips (LayerDrop: ``continue`` in its loop) change only where that happens: a stage whose last
  block was skipped stops at the first stand-in of a later stage's module, sending what flows into it; one whose
  blocks were all skipped sends the received activation on (the last stage feeds it to the first module after
  the blocks);
* on the last stage the step runs to its end: its loss, weighted by the micro-batch's share of the batch, is the
  stage's output, and its ``self.log`` calls are recorded (``log_relay.py``); other stages' logging is silenced.

:class:`StageModule` is the ``nn.Module`` torch's ``PipelineStage`` drives (and data parallelism wraps): it holds the
stage's modules (for their parameters) and calls :meth:`StageExecutor.run_stage`. The micro-batch a call belongs to
is the schedule's chunk id, reported by the pipeline stage before each forward (``pipeline.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from . import hf_outputs, torch_compat
from .agreed import mark_agreed
from .blocks import BLOCKS_CONTRACT, ModelSplit
from .boundary_check import Checked, check_first_step, meta_copy
from .carry import CarryPlan, map_floating, passed_on, sendable, settled
from .checkpointing import inside_reentrant_checkpoint, reentrant_checkpoint_message
from .log_relay import LogRecorder, StepLogs, silenced
from .loss_weights import MicroBatchWeights
from .stand_ins import Elsewhere, Skipped
from .step import MicroBatchLoss, count_of, extract_loss, slice_batch


class _StageDone(BaseException):
    # user's `except Exception` inside training_step cannot swallow it
    def __init__(self, output: torch.Tensor) -> None:
        super().__init__("stage output captured")
        self.output = output


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    if isinstance(value, Mapping):
        return next((v for v in value.values() if isinstance(v, torch.Tensor)), None)
    return getattr(value, "last_hidden_state", None)


@dataclass
class _Running:
    """What the stage being run right now needs: set by ``run_stage`` for the duration of one forward."""

    stage: int
    received: torch.Tensor | None
    last_block: nn.Module | None  # stops the step (all but the last stage)
    first_block_name: str | None = None
    checking: bool = False  # this forward checks that nothing but `received` crosses the boundary
    started: bool = False  # a block of the stage has been called (the first one called got ``received``)
    last_called: int = -1  # position in the stage of the last block called (a lower one again: a second model call)
    stand_ins: dict[int, tuple[str, torch.Tensor]] = field(default_factory=dict)
    # the values the boundaries carry (``carry.py``) that this micro-batch has so far: received, or made here
    carried: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)


class StageModule(nn.Module):
    """One pipeline stage: the modules it holds (for their parameters) and a forward that runs the user's step.

    Args:
        index: the stage's global index.
        held: the modules this stage holds, by their names in the model (shared with the model, not copies).
        executor: runs the step for this stage.
    """

    def __init__(self, index: int, held: Mapping[str, nn.Module], executor: StageExecutor) -> None:
        super().__init__()
        self.index = index
        self.names = list(held)
        self.held = nn.ModuleList(held.values())
        self.__dict__["_executor"] = executor

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self._executor.run_stage(self.index, inputs)


class StageExecutor(MicroBatchLoss):
    """Runs one micro-batch of the user's hook on one of this rank's stages (see the module docstring).

    Args:
        module: the LightningModule (already pruned to this rank's stages).
        split: which modules each stage holds.
        local_stages: the stages this rank holds.
        whole: one stage holds the whole module (pp = 1 without a block container): nothing is arranged.
        skeleton: a meta-device copy of the unsplit model (``boundary_check.make_skeleton``), or why none could be
            made: :meth:`check_first_step` checks the stage boundaries with it before the first training step.
        device: the stage's device (what a stand-in's parameter reports as its device).
        carry: what the boundaries carry besides the flowing tensor, when the setup check found it (else the
            first step's check finds it).
    """

    def __init__(
        self,
        module: LightningModule,
        split: ModelSplit,
        local_stages: Sequence[int],
        whole: bool = False,
        skeleton: nn.Module | str | None = None,
        device: torch.device | None = None,
        carry: CarryPlan | None = None,
    ) -> None:
        self.module, self.split, self.device = module, split, device
        self.carry = CarryPlan()
        self._producers: set[str] = set()  # modules with a forward hook that keeps what they make for later stages
        self._traced: set[str] = set()  # the hooks whose first batch was checked on the skeleton
        self.num_stages = split.num_stages
        self.local_stages = list(local_stages)
        self.current: _Running | None = None
        self.chunk: dict[int, int] = {}
        self._checked: set[int] = set()  # stages whose first training forward was checked for skip connections
        self._skeleton = skeleton
        self.logs = StepLogs()
        self.outputs: list[Any] = []
        self.recorder = LogRecorder(module, self.logs)
        self._step_fn: Callable[..., Any] | None = None
        self._batch: Any = None
        self._rest: tuple[Any, ...] = ()
        self._total = 0
        self._n_micro = 1
        self._scale: float | torch.Tensor = 1.0
        self._weights: MicroBatchWeights | None = None
        self._train = True
        self._hook = "training_step"
        container = split.container
        self._blocks: dict[int, list[nn.Module]] = {s: [] for s in local_stages}
        self._swaps: dict[int, list[tuple[nn.Module, str, nn.Module]]] = {s: [] for s in local_stages}
        self._stand_ins: list[Any] = []
        self._units: set[str] = set()  # the split's blocks and modules outside them, on any stage
        self._before_first: dict[int, str] = {}  # stage -> the block before its first (``flowing_past``)
        self._replays = WeakIdKeyDictionary()  # flowing tensor -> {stand-in: what it returned} (``replayed``)
        self._recorders = hf_outputs.Recorders({}, [])
        if whole or container is None:
            return
        self._blocks = {
            s: [torch_compat.child_modules(container.module)[b] for b in split.stage_blocks[s]] for s in local_stages
        }
        held = {name for s in local_stages for name in split.modules_of(s)}
        self._units = {name for s in range(split.num_stages) for name in split.modules_of(s)}
        # the stand-ins run the recorders of the blocks they stand for; the model's own are put on at the first
        # forward that asks for an output, as Hugging Face does (a compiled block keeps its graph otherwise)
        self._recorders = hf_outputs.Recorders.taken(module)
        hf_outputs.on_request(module, lambda _: self._recorders.install())
        # Modules this rank holds that a given local stage does not: stood in for while that stage runs.
        for stage in local_stages:
            mine = set(split.modules_of(stage))
            swaps = []
            for name in sorted(held - mine, key=lambda n: _order(split, n)):
                parent_name, _, attr = name.rpartition(".")
                parent = module.get_submodule(parent_name) if parent_name else module
                stand_in = self._stand_in(name)
                swaps.append((parent, attr, stand_in))
            self._swaps[stage] = swaps
        # every block of a later stage: the model may skip some (LayerDrop), so the first one called gets ``received``
        # (the first stage receives nothing: no hook on its blocks)
        self._position = {id(b): (s, i) for s in local_stages if s > 0 for i, b in enumerate(self._blocks[s])}
        # the block just before each later local stage's first one: its stand-in returns the received activation
        names = list(container.names)
        self._before_first = {
            s: container.block_fqn(names[names.index(split.stage_blocks[s][0]) - 1])
            for s in local_stages
            if s > 0 and split.stage_blocks[s] and names.index(split.stage_blocks[s][0]) > 0
        }
        for stage in local_stages:
            blocks = self._blocks[stage]
            for block in blocks if stage > 0 else ():
                block.register_forward_pre_hook(self._receive, with_kwargs=True)
            if stage < self.num_stages - 1:
                blocks[-1].register_forward_hook(self._stop)
        if self.num_stages - 1 in local_stages:  # the last stage's blocks all skipped: its first module after them
            for name in split.last:
                if split.stage_of(name) == self.num_stages - 1:
                    module.get_submodule(name).register_forward_pre_hook(self._receive_after, with_kwargs=True)
        if carry is not None:
            self.use_carry(carry)

    # ------------------------------------------------------------------ stand-ins and hooks
    def _stand_in(self, name: str) -> nn.Module:
        """The stand-in for the module ``name`` (still the real one in the model), with its meta copy."""
        real = self.module.get_submodule(name)
        like = meta_copy(real)
        like = like if isinstance(like, nn.Module) else None
        self._stand_ins.append(stand_in := self._new_stand_in(name, like))
        where = f"{name} (pipeline stage {self.split.stage_of(name)})"
        hf_outputs.copy_recorders(real, stand_in, name, where, self.carried_output, self._recorders)
        return stand_in

    def _new_stand_in(self, name: str, like: nn.Module | None) -> nn.Module:
        if name in self.split.first:
            return Elsewhere(name, "first", self, like)
        if name in self.split.last:
            return Elsewhere(name, "last", self, like)
        return Skipped(name, self, like)

    @property
    def recorders(self) -> hf_outputs.Recorders:
        """Hugging Face's recorders of the modules this rank holds, put on when a forward first asks for an output."""
        return self._recorders

    def convert_stand_ins(self, convert: Callable[[nn.Module], Any]) -> None:
        """Apply the precision plugin's module conversion to the stand-ins' meta copies, as to the model."""
        for stand_in in self._stand_ins:
            stand_in.convert_like(convert)

    def stand_in_output(self, value: Any, fqn: str) -> Any:
        """What a stand-in returns. While a stage's first forward is being checked, a floating-point value becomes
        a fresh leaf that requires grad, so :meth:`_check_no_skip` can tell whether the stage's output depends on
        it: it must not (the real value lives on another stage)."""
        current = self.current
        if current is None or not current.checking or not isinstance(value, torch.Tensor):
            return value
        if not value.is_floating_point():
            return value
        leaf = value.detach().requires_grad_(True)
        current.stand_ins[id(leaf)] = (fqn, leaf)
        return leaf

    def use_carry(self, plan: CarryPlan) -> bool:
        """Carry what ``plan`` names across the boundaries from now on (with what was carried so far); whether that
        changed anything (the schedules built before then send other tensors: ``carry_key`` tells them apart)."""
        merged = CarryPlan.merged(self.carry, plan)
        if merged == self.carry:
            return False
        self.carry = merged
        for stage in self.local_stages:
            for name in merged.made_on(stage):
                if name not in self._producers:
                    self._producers.add(name)
                    keep = self._keeper(name, stage)
                    # a stage unit's keeper goes first (it settles a pending reduction that the unit's other hooks
                    # then see); a module inside a unit that Hugging Face records from keeps what its other hooks
                    # made of the output (``hf_outputs.gather_recorded_heads``: all the heads under tensor parallelism)
                    unit = name in self._units
                    self.module.get_submodule(name).register_forward_hook(keep, prepend=unit)
        if merged.values:
            rank_zero_info(
                "lightning_3d: besides the activation flowing from block to block, the pipeline stage boundaries "
                f"carry what later stages read: {merged.describe()}."
            )
        return True

    @property
    def carry_key(self) -> tuple[tuple[str, int, int], ...]:
        """Identifies what the boundaries carry (part of a schedule's cache key: its stages send these tensors)."""
        return tuple((v.module, v.index, v.last) for v in self.carry.values)

    def _keeper(self, name: str, stage: int) -> Callable[..., Any]:
        def keep(module: nn.Module, args: Any, output: Any) -> Any:
            current = self.current
            if current is None or current.stage != stage:
                return None
            wanted = self.carry.of_module(name)  # read now: a later hook's check may carry more of its outputs
            changed = []

            def settle(index: int, tensor: torch.Tensor) -> torch.Tensor:
                if index not in wanted:
                    return tensor
                current.carried[(name, index)] = kept = settled(tensor)
                if kept is not tensor:
                    changed.append(index)
                return kept

            new = map_floating(output, settle)
            return new if changed else None  # a pending tensor-parallel reduction done once, here

        return keep

    def carried_output(self, fqn: str) -> dict[int, torch.Tensor]:
        """The values of ``fqn``'s output this stage received (its stand-in returns them in their places)."""
        current = self.current
        if current is None or not current.carried:
            return {}
        return {index: value for (name, index), value in current.carried.items() if name == fqn}

    def check_first_step(self, hook: str, batch: Any, rest: tuple[Any, ...], total: int, n_micro: int) -> bool:
        """Before a hook's first batch runs its schedule (no rank has communicated for it yet): check what crosses
        the stage boundaries by running the skeleton's ``hook`` on fake tensors shaped like the first micro-batch,
        and carry the module outputs later stages read (``carry.py``). Every rank runs it alike, so every rank
        finds the same values and raises the same error. When it cannot run on fake tensors, the first real
        training forward of each stage is checked instead (:meth:`_check_no_skip`) and rank 0 warns why.

        Returns:
            Whether what the boundaries carry changed (the schedules built before send other tensors).

        Raises:
            ValueError: a tensor crosses a stage boundary that cannot be carried (marked agreed).
        """
        skeleton = self._skeleton
        if skeleton is None or hook in self._traced:
            return False
        self._traced.add(hook)
        training = hook == "training_step"
        if training:
            self._skeleton = None  # checked in training: freed (an evaluation hook after it uses the same plan)
        if isinstance(skeleton, str):
            checked = Checked(skeleton)
        else:
            length = total // n_micro
            micro_batch = slice_batch(batch, 0, length, total)
            try:
                checked = check_first_step(skeleton, self.split, hook, micro_batch, rest)
            except ValueError as err:
                raise mark_agreed(err) from None
            finally:
                del skeleton
        if checked.not_checked:
            if training:
                rank_zero_warn(
                    f"lightning_3d: training_step could not run on fake tensors before the first step "
                    f"({checked.not_checked}); what crosses the pipeline stage boundaries is checked during the "
                    "first training step instead, and nothing but the activation flowing from block to block "
                    "crosses them."
                )
            return False
        if training:
            self._checked.update(self.local_stages)  # checked on the whole model: the in-schedule check is not needed
        return self.use_carry(checked.carry)

    def _check_no_skip(self, stage: int, output: torch.Tensor) -> None:
        """Raise if ``output`` depends on a stand-in's value: a tensor crossed the stage boundary outside the
        block-to-block path (a skip connection across stages, or a residual added outside the blocks)."""
        current = self.current
        assert current is not None
        if not current.stand_ins or output.grad_fn is None:
            return
        seen, todo = set(), [output.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            variable = getattr(node, "variable", None)
            if variable is not None and id(variable) in current.stand_ins:
                source = current.stand_ins[id(variable)][0]
                first = current.first_block_name or "its first block"
                raise ValueError(
                    f"lightning_3d: pipeline stage {stage} (from {first}) uses the output of {source}, which another "
                    f"stage holds: a skip connection crosses the stage boundary between {source} and {first}. The "
                    "outputs of modules that later stages read (an encoder's output, a position bias the first layer "
                    "returns for the others) are carried across the boundaries only when the check before the first "
                    "step runs the step on fake tensors, which it could not (rank 0 warned why): so only the tensor "
                    "flowing from block to block crosses stages here. Make training_step run on fake tensors (no "
                    ".item() or Python branch on a tensor's value), give the module an example_input_array that the "
                    "forward runs on, or choose stage boundaries that no such value crosses. "
                    f"{BLOCKS_CONTRACT}"
                )
            todo.extend(next_node for next_node, _ in node.next_functions)

    def prune(self) -> None:
        """Replace every module of the split that no local stage holds by its stand-in (frees its parameters)."""
        container = self.split.container
        if container is None:
            return
        held = {name for s in self.local_stages for name in self.split.modules_of(s)}
        every = set(self.split.first) | set(self.split.last)
        every |= {container.block_fqn(b) for b in container.names}
        for name in every - held:
            parent_name, _, attr = name.rpartition(".")
            parent = self.module.get_submodule(parent_name) if parent_name else self.module
            real = torch_compat.child_modules(parent)[attr]
            torch_compat.child_modules(parent)[attr] = self._stand_in(name)
            if real is not None:
                self._recorders.forget(real)  # not kept alive for its recorders

    def _receive(self, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Before each block of the stage: the first one called (the stage's first block, or a later one when the
        model skips blocks) gets the received activation as its flowing tensor; a block before the last one called
        means the model runs a second time."""
        current = self.current
        stage, index = self._position.get(id(block), (None, -1))
        if current is None or stage != current.stage:
            return None
        first = current.last_called < 0
        if index <= current.last_called and current.received is not None:
            # a second model call in one step (generate(), a second forward pass)
            raise ValueError(
                f"lightning_3d: {type(self.module).__name__}.{self._hook} ran the model a second time on pipeline "
                f"stage {current.stage}; under pipeline parallelism a step runs the model once per micro-batch (the "
                "stage gets one received activation per micro-batch, so a second call cannot be fed). Generation "
                "(Hugging Face generate() runs the model once per new token) and other repeated calls need pp=1: "
                "tensor and data parallelism run them unchanged, so generate in a run at pp=1 (a trainer.validate / "
                f"predict of the checkpoint with ThreeDStrategy(tp=..., pp=1)). {BLOCKS_CONTRACT}"
            )
        current.last_called = index
        if not first or current.received is None:
            return None
        if self._train and inside_reentrant_checkpoint():
            name = self.split.container.block_fqn(self.split.stage_blocks[stage][index]) if self.split.container else ""
            raise ValueError(reentrant_checkpoint_message(name, stage, "first"))
        current.started = True
        return _with_flowing(current.received, args, kwargs, f"the first block of pipeline stage {current.stage}")

    def flowing_past(self, fqn: str) -> torch.Tensor | None:
        """What the stand-in for the block ``fqn`` returns as the tensor flowing on: the received activation when
        ``fqn`` is the block just before the running stage's first one (what that block's output is: the earlier stage
        sent it), else None (the stand-in passes its input on). The stage's first block then gets the received tensor
        from the model's own code, not only from its pre-hook: a forward that calls the block through
        ``torch.utils.checkpoint`` (non-reentrant) recomputes it in the backward from the input the checkpoint kept
        (the pre-hook, outside any stage then, changes nothing). Inside a reentrant checkpoint (which the hooks
        refuse at a boundary) it returns None: such a checkpoint's output must not be the received tensor itself."""
        current = self.current
        if current is None or current.received is None or current.started or current.last_called >= 0:
            return None
        if current.received.requires_grad and not torch.is_grad_enabled():
            return None  # inside a reentrant checkpoint (see above)
        return current.received if self._before_first.get(current.stage) == fqn else None

    def remember(self, fqn: str, value: torch.Tensor, output: Any) -> None:
        """The stand-in for ``fqn`` returned ``output`` (the received activation, or a marked copy of ``value`` while
        the first forward is checked) for the flowing tensor ``value``: kept while ``value`` lives, for
        :meth:`replayed`."""
        self._replays.setdefault(value, {})[fqn] = output

    def replayed(self, fqn: str, value: torch.Tensor) -> Any:
        """What the stand-in for ``fqn`` returns when it is called with no stage running: what it returned in the
        stage's forward for the same tensor, when a backward recomputes a ``torch.utils.checkpoint`` whose function
        runs blocks of two stages (it calls the stand-ins again with the input it kept); ``None`` for a stand-in that
        passes its input on. The stand-in that returned the received activation, called again with another tensor,
        raises: the recomputation would run the stage's blocks on the stand-ins' values."""
        found = self._replays.get(value, {}).get(fqn)
        if found is not None or fqn not in self._before_first.values():
            return found
        raise RuntimeError(
            f"lightning_3d: {fqn} (held by pipeline stage {self.split.stage_of(fqn)}) was called with no pipeline "
            "stage running, where the stage after it takes the received activation: the model was called outside "
            "the training, validation, test and predict steps, or the backward recomputed a torch.utils.checkpoint "
            "call whose function runs blocks of two pipeline stages from an input that is not the one the checkpoint "
            "kept (the whole forward checkpointed, for one). Checkpoint the blocks one by one, or set "
            f"ThreeDStrategy(activation_checkpointing='full'). {BLOCKS_CONTRACT}"
        )

    def _receive_after(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Before a module after the blocks on the last stage: when the model skipped all of the stage's blocks
        (LayerDrop), the received activation is what flows into it."""
        current = self.current
        if current is None or current.started or current.received is None or current.stage != self.num_stages - 1:
            return None
        current.started = True
        return _with_flowing(current.received, args, kwargs, f"{type(module).__name__} after the blocks")

    def reached(self, fqn: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A stand-in was called: when it stands in for a module of a later stage, the model went past this stage's
        blocks without calling the last one (it skipped blocks: LayerDrop), and the stage ends here, sending the
        flowing tensor (the received one when no block of the stage ran)."""
        current = self.current
        if current is None or current.last_block is None or self.split.stage_of(fqn) <= current.stage:
            return
        if current.received is not None and not current.started:
            raise _StageDone(passed_on(current.received))
        flowing = args[0] if args else next(iter(kwargs.values()), None)
        if not isinstance(flowing, torch.Tensor):
            raise ValueError(
                f"lightning_3d: pipeline stage {current.stage} reached {fqn} (held by a later stage) without a tensor "
                f"as its first argument; the tensor flowing from block to block must be the first. {BLOCKS_CONTRACT}"
            )
        raise _StageDone(flowing)

    def _stop(self, block: nn.Module, args: Any, output: Any) -> None:
        current = self.current
        if current is None or block is not current.last_block:
            return
        if self._train and inside_reentrant_checkpoint():
            assert self.split.container is not None
            name = self.split.container.block_fqn(self.split.stage_blocks[current.stage][-1])
            raise ValueError(reentrant_checkpoint_message(name, current.stage, "last"))
        tensor = _first_tensor(output)
        if tensor is None:
            raise ValueError(
                f"lightning_3d: the last block of pipeline stage {current.stage} returned {type(output).__name__}; "
                f"a block must return the tensor that flows to the next block (or a tuple starting with it). "
                f"{BLOCKS_CONTRACT}"
            )
        raise _StageDone(tensor)

    @contextlib.contextmanager
    def _arranged(
        self, stage: int, received: torch.Tensor | None, checking: bool = False, carried: Sequence[torch.Tensor] = ()
    ) -> Iterator[None]:
        swaps = self._swaps[stage]
        saved = [(parent, attr, torch_compat.child_modules(parent)[attr]) for parent, attr, _ in swaps]
        for parent, attr, stand_in in swaps:
            torch_compat.child_modules(parent)[attr] = stand_in
        blocks = self._blocks[stage]
        last = blocks[-1] if blocks and stage < self.num_stages - 1 else None
        first_name = None
        if self.split.container is not None and self.split.stage_blocks[stage]:
            first_name = self.split.container.block_fqn(self.split.stage_blocks[stage][0])
        self.current = _Running(stage, received, last, first_name, checking and stage > 0)
        keys = [v.key for v in self.carry.received_by(stage)]
        if len(keys) != len(carried):
            raise AssertionError(f"stage {stage} received {len(carried)} carried values, {len(keys)} expected")
        self.current.carried.update(zip(keys, carried, strict=True))
        try:
            yield
        finally:
            self.current = None
            for parent, attr, real in saved:
                torch_compat.child_modules(parent)[attr] = real

    def _sent(self, stage: int, output: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """What ``stage`` sends the next stage: its last block's output, then the values the boundary carries."""
        crossing = self.carry.crossing(stage)
        if not crossing:
            return output
        current = self.current
        assert current is not None
        missing = [v for v in crossing if v.key not in current.carried]
        if missing:
            raise ValueError(
                f"lightning_3d: on pipeline stage {stage} the forward did not call {missing[0].module} this time, "
                f"whose output a later stage reads ({missing[0].describe()}, found by the check before the first "
                "step); every step must run the model the same way under pipeline parallelism."
            )
        sent = [
            sendable(current.carried[v.key]) if v.stage == stage else passed_on(current.carried[v.key])
            for v in crossing
        ]
        return (output, *sent)

    # ------------------------------------------------------------------ one batch, one micro-batch
    def begin(
        self,
        hook: str,
        step_fn: Callable[..., Any],
        batch: Any,
        rest: tuple[Any, ...],
        total: int,
        n_micro: int,
        scale: float | torch.Tensor,
        train: bool,
        weights: MicroBatchWeights | None = None,
    ) -> None:
        """Set up one batch of ``hook`` (``total`` samples in ``n_micro`` equal micro-batches); ``weights``: the
        micro-batches' label-token weights (``None``: by samples)."""
        self._hook, self._step_fn, self._batch, self._rest = hook, step_fn, batch, rest
        self._total, self._n_micro, self._scale, self._train = total, n_micro, scale, train
        self._weights = weights
        self.logs = StepLogs()
        self.recorder.logs = self.logs
        self.outputs = []
        self.chunk.clear()

    def finish(self) -> tuple[StepLogs, list[Any]]:
        """The batch's logs and per-micro-batch outputs (last stage), and forget the batch."""
        logs, outputs = self.logs, self.outputs
        self._batch, self._step_fn = None, None
        return logs, outputs

    def on_chunk(self, stage: int, chunk: int | None) -> None:
        """Called by the pipeline stage before each forward: which micro-batch it is (``None``: shape inference)."""
        if chunk is None:
            self.chunk.pop(stage, None)
        else:
            self.chunk[stage] = chunk

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function: the last stage's output already is the weighted loss (shape ``(1,)``, so
        that torch can join the micro-batches' outputs; back to a scalar here)."""
        return output.sum()

    def run_stage(self, stage: int, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """One forward of ``stage`` on its current micro-batch; returns what the stage sends on (or the loss)."""
        assert self._step_fn is not None, "run_stage outside a batch"
        chunk = self.chunk.get(stage)
        inferring = chunk is None  # torch's shape inference: a forward on the first micro-batch's shapes
        chunk = chunk or 0
        length = self._total // self._n_micro
        micro_batch = slice_batch(self._batch, chunk * length, length, self._total)
        received = inputs[0] if stage > 0 and inputs else None
        carried = inputs[1:] if stage > 0 else ()
        last = stage == self.num_stages - 1
        if inferring and last:
            return _inferred_loss(inputs)
        record = last and not inferring
        logging = self.recorder.recording(length, count_of(self._weights, chunk)) if record else silenced(self.module)
        checking = stage not in self._checked and torch.is_grad_enabled()
        with self._arranged(stage, received, checking, carried), logging:
            try:
                result = self._step_fn(micro_batch, *self._rest)
            except _StageDone as done:
                if last:
                    raise AssertionError("the last stage was stopped early") from None
                if checking:
                    self._check_no_skip(stage, done.output)
                    self._checked.add(stage)
                return self._sent(stage, done.output)
            if checking and last:
                loss = extract_loss(result, self._hook) if isinstance(result, (torch.Tensor, Mapping)) else None
                if isinstance(loss, torch.Tensor):
                    self._check_no_skip(stage, loss)
                    self._checked.add(stage)
        if not last:
            if result is None and self._train:  # Lightning's "return None to skip this batch"
                raise ValueError(
                    f"{type(self.module).__name__}.{self._hook} returned None before running the model (on pipeline "
                    f"stage {stage}): skipping a batch this way is not supported under pipeline parallelism, as "
                    "Lightning does not support it under DDP either; every rank must run each step. Leave such "
                    "batches out in the data pipeline (the Dataset, a sampler or collate_fn) instead."
                )
            raise ValueError(
                f"{type(self.module).__name__}.{self._hook} returned without running the blocks of pipeline stage "
                f"{stage}; under pipeline parallelism every {self._hook} must run the model once. {BLOCKS_CONTRACT}"
            )
        loss = self._loss_of(result, chunk, length)
        # a (1,)-shaped output, so that torch can join the micro-batches' outputs (loss_fn sums it back)
        return torch.zeros(1, device=_device(inputs)) if loss is None else loss.reshape(1)


def _with_flowing(value: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any], who: str) -> Any:
    """A forward pre-hook's result: the call's flowing tensor (its first argument) replaced by ``value``."""
    if args and isinstance(args[0], torch.Tensor):
        return (value, *args[1:]), kwargs
    for key in ("hidden_states", "x", "hidden", "input", "inputs"):
        if isinstance(kwargs.get(key), torch.Tensor):
            return args, {**kwargs, key: value}
    raise ValueError(
        f"lightning_3d: {who} was called without a tensor as its first argument; the tensor flowing from block to "
        f"block must be the first argument. {BLOCKS_CONTRACT}"
    )


def _inferred_loss(inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """What the last stage returns to torch's shape inference, without running the user's step.

    The step's code after the model call (a torchmetrics ``update``, ``self.outputs.append(...)``) runs on the last
    stage only and must see each micro-batch once; torch's inference forward on the first micro-batch would have
    run it once more: the first evaluation (or training) batch of every fit / validate / test counted micro-batch 0
    twice in such state (hidden under sanity validation, whose epoch absorbed it). The last stage's output is a
    loss-shaped ``(1,)`` tensor that nothing receives; torch 2.13 then infers the input gradients' shapes from a
    backward of it, so it depends on every received tensor that needs a gradient (zero gradients of their shapes
    and dtypes)."""
    loss = torch.zeros(1, device=_device(inputs))
    for received in inputs:
        if received.is_floating_point() and received.requires_grad:
            local = received.to_local() if isinstance(received, DTensor) else received
            loss = loss + (local * 0).sum()
    return loss


def _device(inputs: Sequence[torch.Tensor]) -> torch.device | None:
    return inputs[0].device if inputs else None


def _order(split: ModelSplit, name: str) -> int:
    container = split.container
    names = split.first + ([container.block_fqn(b) for b in container.names] if container else []) + split.last
    return names.index(name) if name in names else len(names)
