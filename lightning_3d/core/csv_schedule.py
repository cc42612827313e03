"""Pipeline schedules read from a CSV action list (``schedule="path/to/actions.csv"``).

The file is torch's compute-only schedule format (what ``_PipelineScheduleRuntime._load_csv`` reads): one row
per pp rank, one cell per time slot, each cell an action ``<stage><kind><micro-batch>`` or empty (idle):
``F`` forward, ``B`` full backward, ``I`` input-gradient backward, ``W`` its deferred weight-gradient backward.
``0F1`` is stage 0's forward of micro-batch 1. Communication (sends, receives) and the gradient reduction are
added by torch's lowering, so the file holds computation only.

Everything the rest of the project needs is read from the file: the number of pp ranks (rows), of stages
(the highest stage index + 1), of micro-batches (forwards per stage) and the placement (the rank whose row
runs a stage). :func:`read_csv_schedule` checks it once, with torch's own validation, and the settings compare
it with ``pp``, ``stages_per_rank`` and ``micro_batches``, so a file that does not fit the run fails at
construction with a message, not in the first step. :func:`pipeline.write_csv_schedule` writes the action list
of one of torch's named schedules, a known-good starting point to edit.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from . import torch_compat


@dataclass(frozen=True)
class CsvSchedule:
    """What a CSV action list fixes about the run.

    Attributes:
        path: the file (absolute).
        pp: pipeline ranks (rows).
        num_stages: pipeline stages (highest stage index + 1).
        micro_batches: micro-batches per batch (forwards of each stage).
        placement: ``placement[s]`` is the pp rank that runs stage ``s``.
        split_backward: whether the list splits backwards into input- (``I``) and weight-gradient (``W``) actions.
        rows: the file's cells, one tuple per pp rank (``torch_compat.parse_schedule_actions`` reads them).
    """

    path: str
    pp: int
    num_stages: int
    micro_batches: int
    placement: tuple[int, ...]
    split_backward: bool
    rows: tuple[tuple[str, ...], ...] = ()

    @property
    def stages_per_rank(self) -> int:
        """Stages each rank runs (every rank runs as many: checked when read)."""
        return self.num_stages // self.pp


def is_csv_schedule(name: object) -> bool:
    """Whether ``name`` names a CSV action list (a path ending in ``.csv``) rather than a schedule."""
    return isinstance(name, (str, os.PathLike)) and str(name).strip().lower().endswith(".csv")


def read_csv_schedule(path: str | os.PathLike[str]) -> CsvSchedule:
    """Read and check the action list in ``path`` (cached per file and modification time).

    Raises:
        ValueError: the file is missing, or is not a valid compute-only action list (the message says where).
    """
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_file():
        raise ValueError(
            f"ThreeDStrategy(schedule={str(path)!r}): no such file ({resolved}). A schedule ending in .csv is a "
            "CSV action list: one row per pp rank, one action per cell (e.g. 0F0,0F1,0B0,...)."
        )
    return _read(str(resolved), resolved.stat().st_mtime_ns)


@lru_cache(maxsize=16)
def _read(path: str, _mtime_ns: int) -> CsvSchedule:
    where = f"ThreeDStrategy(schedule={path!r})"
    with open(path, newline="") as handle:
        rows = [row for row in csv.reader(handle)]
    while rows and not any(cell.strip() for cell in rows[-1]):  # trailing blank lines
        rows.pop()
    if not rows:
        raise ValueError(f"{where}: the file is empty; it needs one row of actions per pp rank.")
    try:
        order = torch_compat.parse_schedule_actions(rows)
    except ValueError as bad:
        raise ValueError(f"{where}: {bad}") from None
    actions = [(rank, a) for rank, row in order.items() for a in row if a is not None]
    comms = [f"{a} (rank {rank})" for rank, a in actions if not torch_compat.is_compute_action(a)]
    if comms:
        raise ValueError(
            f"{where}: the file must hold computation only (F, B, I, W actions); communication and resharding "
            f"are added by torch's lowering. Found {', '.join(comms[:4])}."
        )
    if not actions:
        raise ValueError(f"{where}: the file holds no action.")
    num_stages = 1 + max(a.stage_index for _, a in actions)
    micro = {a.microbatch_index for _, a in actions if a.stage_index == 0 and torch_compat.action_kind(a) == "F"}
    n_micro = len(micro)
    pp = len(order)
    try:
        mapping = torch_compat.validate_schedule_actions(order, pp, num_stages, n_micro)
    except ValueError as bad:
        raise ValueError(f"{where} is not a valid action list: {bad}") from None
    missing = [s for s in range(num_stages) if s not in mapping]
    if missing:
        raise ValueError(f"{where}: stages {missing} have no action (stages are numbered 0..{num_stages - 1}).")
    if micro != set(range(n_micro)):
        raise ValueError(f"{where}: micro-batches are numbered 0..m-1; stage 0 runs {sorted(micro)}.")
    placement = tuple(mapping[s] for s in range(num_stages))
    counts = [placement.count(r) for r in range(pp)]
    if len(set(counts)) != 1:
        raise ValueError(
            f"{where}: every pp rank must run as many stages; the file places {counts} stages on ranks "
            f"0..{pp - 1} (placement stage -> rank: {list(placement)})."
        )
    if counts[0] == 1 and placement != tuple(range(pp)):
        raise ValueError(
            f"{where}: with one stage per rank, stage s must run on pp rank s (row s); the file places stages on "
            f"ranks {list(placement)}."
        )
    split = any(torch_compat.action_kind(a) in ("I", "W") for _, a in actions)
    return CsvSchedule(path, pp, num_stages, n_micro, placement, split, tuple(tuple(row) for row in rows))


def check_fits(schedule: CsvSchedule, pp: int, stages_per_rank: int) -> None:
    """Raise ``ValueError`` unless the action list fits ``pp`` and ``stages_per_rank`` (the message says which
    setting to change)."""
    where = f"ThreeDStrategy(schedule={schedule.path!r})"
    if schedule.pp != pp:
        raise ValueError(
            f"{where}: the action list has {schedule.pp} rows (pp ranks) but pp={pp}. Use pp={schedule.pp} or a "
            f"file with {pp} rows."
        )
    if schedule.stages_per_rank != stages_per_rank:
        raise ValueError(
            f"{where}: the action list runs {schedule.num_stages} stages on {schedule.pp} ranks "
            f"({schedule.stages_per_rank} per rank, placement stage -> rank {list(schedule.placement)}) but "
            f"stages_per_rank={stages_per_rank}. Use stages_per_rank={schedule.stages_per_rank}."
        )


def zero_bubble_greedy_rows(pp: int, micro_batches: int) -> list[list[str]]:
    """The action list of a greedy zero-bubble schedule with one stage per rank, which torch has no name for:
    1F1B with each backward split into its input-gradient ``I`` (on the critical path) and its weight-gradient
    ``W``, deferred to fill what would be idle time (the idea of Qi et al., "Zero Bubble Pipeline
    Parallelism", 2023).

    Built by a greedy simulation in unit time slots (every action one slot, free communication): in each slot a
    rank runs its next ready input-gradient, else its next ready forward (while fewer than ``2 pp - rank``
    micro-batches have not finished their weight-gradient: the activations it keeps in flight, against 1F1B's
    ``pp - rank``), else its oldest deferred weight-gradient, else idles. Its bubble is then ZB-H1's,
    ``(pp - 1) / (3 m + pp - 1)`` against 1F1B's ``(pp - 1) / (m + pp - 1)``; the price is up to twice 1F1B's
    activation memory (``2 pp - rank`` micro-batches on rank ``rank``, whatever ``m``). The rows are time-aligned
    (an empty cell is an idle slot), so the list's idle share is the theoretical bubble.
    """
    if micro_batches < pp:
        raise ValueError(f"the greedy zero-bubble schedule needs micro_batches >= pp ({micro_batches} < {pp}).")
    done: dict[tuple[str, int, int], int] = {}  # (kind, stage, micro-batch) -> slot it ran in
    next_f, next_i = [0] * pp, [0] * pp
    deferred: list[list[int]] = [[] for _ in range(pp)]
    weights_done = [0] * pp
    rows: list[list[str]] = [[] for _ in range(pp)]
    slot = 0
    while any(weights_done[r] < micro_batches for r in range(pp)):

        def ran_before(key: tuple[str, int, int], now: int = slot) -> bool:
            return done.get(key, now) < now

        chosen = []
        for rank in range(pp):
            mb_i, mb_f = next_i[rank], next_f[rank]
            if mb_i < mb_f and ran_before(("F", rank, mb_i)) and (rank == pp - 1 or ran_before(("I", rank + 1, mb_i))):
                action = ("I", mb_i)
            elif (
                mb_f < micro_batches
                and (rank == 0 or ran_before(("F", rank - 1, mb_f)))
                and mb_f - weights_done[rank] < 2 * pp - rank
            ):
                action = ("F", mb_f)
            elif deferred[rank]:
                action = ("W", deferred[rank][0])
            else:
                rows[rank].append("")
                continue
            chosen.append((rank, *action))
            rows[rank].append(f"{rank}{action[0]}{action[1]}")
        for rank, kind, mb in chosen:
            done[(kind, rank, mb)] = slot
            if kind == "F":
                next_f[rank] += 1
            elif kind == "I":
                next_i[rank] += 1
                deferred[rank].append(mb)
            else:
                deferred[rank].pop(0)
                weights_done[rank] += 1
        slot += 1
        if slot > 10 * pp * micro_batches:  # the rules above always make progress; guard the loop anyway
            raise RuntimeError("zero-bubble simulation did not finish")
    while all(row and row[-1] == "" for row in rows):  # trailing slots where every rank idles
        for row in rows:
            row.pop()
    return rows


def write_zero_bubble_greedy_csv(pp: int, micro_batches: int, path: str | os.PathLike) -> Path:
    """Write :func:`zero_bubble_greedy_rows` to ``path`` (a CSV schedule for ``stages_per_rank=1``)."""
    out = Path(path)
    with open(out, "w", newline="") as handle:
        csv.writer(handle).writerows(zero_bubble_greedy_rows(pp, micro_batches))
    return out
