"""Plan API: explicit entries, validation messages, styles_for, describe_plan, local_numel, example inputs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from lightning_3d.core.tensor_parallel import (
    STYLE_NAMES,
    PlanEntry,
    TPPlan,
    describe_plan,
    example_input_for,
    local_numel,
    resolve_outer_plan,
    resolve_plan,
)
from lightning_3d.core.tensor_parallel.styles import SharedInputColwiseParallel

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
from tp_models import gpt, mlp_chain


def test_style_names() -> None:
    assert STYLE_NAMES == ("colwise", "rowwise", "colwise_gather", "vocab", "sequence", "replicate")


def test_styles_for_maps_names_to_fresh_torch_styles() -> None:
    plan = resolve_plan(gpt(layers=1), 2, explicit={"body.1.ln_1": "sequence", "body.1.ln_2": "replicate"})
    whole = plan.styles_for("")
    assert "1.ln_2" not in whole, "replicate entries are dropped"
    q, out, head, wte = whole["1.attn.q_proj"], whole["1.attn.out_proj"], whole["2.lm_head"], whole["0.wte"]
    # colwise styles are torch's ColwiseParallel, sharing one input conversion among Linears that read one tensor
    assert type(q) is SharedInputColwiseParallel and isinstance(q, ColwiseParallel)
    assert q.output_layouts == (Shard(-1),) and q.use_local_output
    assert type(out) is RowwiseParallel and out.input_layouts == (Shard(-1),) and out.use_local_output
    assert type(head) is SharedInputColwiseParallel and head.output_layouts == (Replicate(),) and head.use_local_output
    assert type(wte) is RowwiseParallel and wte.input_layouts == (Replicate(),) and wte.use_local_output
    assert type(whole["1.ln_1"]) is SequenceParallel
    assert plan.styles_for("")["1.attn.q_proj"] is not q, "each call must build new style objects"

    layer = plan.styles_for("1")
    assert set(layer) == {"ln_1", "attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj", "mlp.fc", "mlp.proj"}
    assert set(plan.styles_for("2.lm_head")) == {""}
    assert plan.styles_for("5") == {}


def test_tp_one_gives_an_empty_plan_but_still_checks_patterns() -> None:
    assert resolve_plan(gpt(), 1) == TPPlan()
    with pytest.raises(ValueError, match="matches no module"):
        resolve_plan(gpt(), 1, explicit={"body.*.atn.q_proj": "colwise"})
    with pytest.raises(ValueError, match="positive int"):
        resolve_plan(gpt(), 0)


def test_explicit_entries_win_and_globs_match_lightning_and_body_names() -> None:
    plan = resolve_plan(
        gpt(layers=2), 2, explicit={"body.*.attn.*_proj": "replicate", "2.mlp.fc": "replicate", "*.lm_head": "colwise"}
    )
    for i in (1, 2):
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            assert plan.entries[f"{i}.attn.{name}"] == PlanEntry(
                "replicate", "explicit", "explicit plan 'body.*.attn.*_proj'"
            )
    assert plan.entries["1.mlp.fc"].style == "colwise" and plan.entries["1.mlp.fc"].source == "auto"
    assert plan.entries["2.mlp.fc"].style == "replicate"
    assert "2.mlp.proj" not in plan.entries and "2.mlp.proj" in plan.notes  # its partner is replicated
    assert plan.entries["3.lm_head"] == PlanEntry("colwise", "explicit", "explicit plan '*.lm_head'")


def test_explicit_replicate_on_a_parent_covers_its_children() -> None:
    plan = resolve_plan(gpt(layers=1), 2, explicit={"body.1.attn": "replicate"})
    assert plan.entries["1.attn"].style == "replicate"
    assert not [k for k in plan.entries if k.startswith("1.attn.")]
    assert plan.entries["1.mlp.fc"].style == "colwise"


def test_explicit_parallel_style_object_passes_through() -> None:
    style = ColwiseParallel(output_layouts=Replicate())
    plan = resolve_plan(gpt(layers=1), 2, explicit={"body.2.lm_head": style}, auto=False)
    assert list(plan.entries) == ["2.lm_head"] and plan.styles_for("") == {"2.lm_head": style}


def test_typo_in_a_pattern_names_the_closest_modules() -> None:
    with pytest.raises(ValueError, match=r"'body\.\*\.attn\.q_prj' matches no module.*body\.1\.attn\.q_proj"):
        resolve_plan(gpt(), 2, explicit={"body.*.attn.q_prj": "colwise"})


def test_unknown_style_lists_the_style_names() -> None:
    with pytest.raises(
        ValueError,
        match=r"unknown style 'column'.*colwise, rowwise, colwise_gather, vocab, "
        r"sequence, replicate",
    ):
        resolve_plan(gpt(), 2, explicit={"body.1.mlp.fc": "column"})


def test_explicit_size_not_divisible_raises_with_working_tp_values() -> None:
    with pytest.raises(
        ValueError,
        match=r"body\.1\.mlp\.fc .*out_features = 32 is not divisible by tp=3\. "
        r"tp values that work: 1, 2, 4, 8, 16, 32\.",
    ):
        resolve_plan(gpt(), 3, explicit={"body.1.mlp.fc": "colwise"}, auto=False)
    with pytest.raises(ValueError, match=r"body\.0\.wte .*num_embeddings = 30 .*tp values that work: 1, 2, 3, 5"):
        resolve_plan(gpt(vocab=30), 4, explicit={"body.0.wte": "vocab"}, auto=False)


def test_explicit_style_on_the_wrong_module_type_raises() -> None:
    with pytest.raises(ValueError, match=r"body\.1\.ln_1 \(LayerNorm.*applies to nn\.Linear and nn\.Embedding"):
        resolve_plan(gpt(), 2, explicit={"body.1.ln_1": "colwise"})
    with pytest.raises(ValueError, match=r"'vocab' applies to nn\.Embedding modules only"):
        resolve_plan(gpt(), 2, explicit={"body.1.mlp.fc": "vocab"})


def test_describe_plan_lists_sharded_and_noted_modules() -> None:
    body = gpt(fused=True, layers=1)
    text = describe_plan(body, resolve_plan(body, 2), 2)
    lines = text.splitlines()
    assert lines[0] == "Tensor-parallel plan (tp=2): 5 modules sharded, 2 left replicated"
    row = next(line for line in lines if line.startswith("body.1.mlp.fc "))
    assert "Linear" in row and "colwise" in row and "(32, 16) -> (16, 16)" in row and "fc -> proj (MLP)" in row
    row = next(line for line in lines if line.startswith("body.0.wte "))
    assert "Embedding" in row and "vocab" in row and "(32, 16) -> (16, 16)" in row
    row = next(line for line in lines if line.startswith("body.1.attn.c_attn "))
    assert "replicate" in row and "(48, 16) (whole)" in row and "split into parts" in row
    assert not any(line.startswith("body.1.ln_1") for line in lines)
    assert "mlp.fc" in describe_plan(body, resolve_plan(body, 2), 2, body_prefix="model.layers")


def test_local_numel_per_style() -> None:
    plan = TPPlan(
        entries={
            "c": PlanEntry("colwise", "auto"),
            "r": PlanEntry("rowwise", "auto"),
            "g": PlanEntry("colwise_gather", "auto"),
            "v": PlanEntry("vocab", "auto"),
            "x": PlanEntry(RowwiseParallel(), "explicit"),
            "s": PlanEntry("sequence", "explicit"),
        }
    )
    assert local_numel("c.weight", (8, 4), plan, 4) == 8 and local_numel("c.bias", (8,), plan, 4) == 2
    assert local_numel("r.weight", (8, 4), plan, 4) == 8 and local_numel("r.bias", (8,), plan, 4) == 8
    assert local_numel("g.weight", (8, 4), plan, 2) == 16 and local_numel("g.bias", (8,), plan, 2) == 4
    assert local_numel("v.weight", (32, 4), plan, 4) == 32
    assert local_numel("x.weight", (8, 4), plan, 2) == 16 and local_numel("x.bias", (8,), plan, 2) == 8
    assert local_numel("s.weight", (4,), plan, 2) == 4 and local_numel("other.weight", (4, 4), plan, 2) == 16
    assert local_numel("c.weight", (8, 4), plan, 1) == 32


def test_local_numel_matches_resolve_plan_entries() -> None:
    body = gpt(layers=1)
    plan = resolve_plan(body, 2)
    sizes = {n: local_numel(n, tuple(p.shape), plan, 2) for n, p in body.named_parameters()}
    assert sizes["1.attn.q_proj.weight"] == 128 and sizes["1.attn.q_proj.bias"] == 8
    assert sizes["1.attn.out_proj.weight"] == 128 and sizes["1.attn.out_proj.bias"] == 16
    assert sizes["0.wte.weight"] == 256 and sizes["1.ln_1.weight"] == 16


def test_example_input_for() -> None:
    x = example_input_for(gpt())
    assert x is not None and x.dtype == torch.long and tuple(x.shape) == (1, 2)
    y = example_input_for(mlp_chain((8, 16, 4)).double())
    assert y is not None and y.dtype == torch.float64 and tuple(y.shape) == (1, 8)
    with torch.device("meta"):
        z = example_input_for(gpt())
    assert z is not None and z.is_meta
    assert example_input_for(nn.Sequential(nn.Conv1d(2, 2, 1), nn.Linear(2, 2))) is None
    assert example_input_for(nn.Sequential(nn.Flatten(), nn.Linear(2, 2))) is None


def test_resolve_outer_plan_leaves_the_blocks_alone_and_never_fails() -> None:
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from models import RotaryGPT

    model = RotaryGPT()
    model.configure_model()
    before = {n: p.clone() for n, p in model.named_parameters()}
    plan = resolve_outer_plan(model, 2, "blocks", torch.zeros(2, 8, dtype=torch.long))
    assert {n: e.style for n, e in plan.entries.items()} == {"tok": "vocab", "out": "colwise_gather"}
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # left unchanged
    assert local_numel("out.weight", (32, 16), plan, 2) == 16 * 16
    broken = resolve_outer_plan(model, 2, "blocks", torch.zeros(2, 8))  # float token ids: the forward fails
    assert broken.entries == {} and set(broken.notes) == {"tok", "out"}
    assert all("analysis of the whole forward on example_input_array failed" in n for n in broken.notes.values())


class _TiedLM(nn.Module):
    """Embedding, one block, a head tied to the embedding; ``head_reads_shards``: a Linear before the head makes it
    row-parallel (its weight split on the other dimension than the embedding's)."""

    def __init__(self, head_reads_shards: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4)])
        self.up = nn.Linear(4, 4) if head_reads_shards else None
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](self.emb(ids))
        if self.up is not None:
            x = torch.relu(self.up(x))
        return self.head(x)


def test_a_tied_embedding_and_head_are_sharded_alike_or_not_at_all() -> None:
    ids = torch.zeros(2, 3, dtype=torch.long)
    model = _TiedLM()
    plan = resolve_outer_plan(model, 2, "blocks", ids)
    assert {n: e.style for n, e in plan.entries.items()} == {"emb": "vocab", "head": "colwise_gather"}
    assert plan.tied == [("emb.weight", "head.weight")]
    assert "weight tied to head.weight" in plan.entries["emb"].reason
    assert model.head.weight is model.emb.weight  # the analysis ran them untied; the tie is back
    styles = plan.styles_for("")
    assert styles["emb"].ties is styles["head"].ties is plan.ties  # one registry: one DTensor parameter for both
    # the head row-parallel (weight split on dim 1), the embedding on the vocabulary (dim 0): both left whole
    model = _TiedLM(head_reads_shards=True)
    plan = resolve_outer_plan(model, 2, "blocks", ids)
    assert "emb" not in plan.entries and "head" not in plan.entries and plan.tied == []
    assert "tied weights" in plan.notes["emb"] and "tied weights" in plan.notes["head"]
    assert model.head.weight is model.emb.weight


class _Wrapper(nn.Module):
    """A LightningModule-like wrapper whose inner model takes keyword arguments (as a Hugging Face model does)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _KeywordLM()
        self.side = nn.Linear(4, 4)  # outside the inner model: its forward never runs it

    def forward(self, batch: dict) -> torch.Tensor:
        return self.side(self.inner(**batch))


class _KeywordLM(_TiedLM):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(input_ids)


def test_the_outer_analysis_runs_a_submodule_on_keyword_inputs() -> None:
    model = _Wrapper()
    ids = {"input_ids": torch.zeros(2, 3, dtype=torch.long)}
    plan = resolve_outer_plan(model, 2, "inner.blocks", ids, root="inner")
    assert {n: e.style for n, e in plan.entries.items()} == {"inner.emb": "vocab", "inner.head": "colwise_gather"}
    assert plan.tied == [("inner.emb.weight", "inner.head.weight")]
    assert "side" not in plan.entries
    # the whole module on a dict example_input_array: its forward gets the dict as keyword arguments
    plan = resolve_outer_plan(model.inner, 2, "blocks", ids)
    assert {n: e.style for n, e in plan.entries.items()} == {"emb": "vocab", "head": "colwise_gather"}
