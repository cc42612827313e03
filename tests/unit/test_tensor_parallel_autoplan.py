"""The automatic tensor-parallel plan: what the data-flow analysis shards and what it refuses."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_3d.core.rng import closes_region, opens_region
from lightning_3d.core.tensor_parallel import describe_plan, resolve_plan
from lightning_3d.core.tensor_parallel.analyzer import acts_as_linear, head_counts
from lightning_3d.core.tensor_parallel.shapes import Refuse, map_getitem, map_view
from lightning_3d.core.tensor_parallel.styles import CopiedOutput, LocalHeadCounts, style_kind

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
from tp_models import Attention, Block, Embed, Head, InOut, gpt, mlp_chain, swiglu_model


def styles(plan) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {k: e.style for k, e in plan.entries.items()}


def gpt_expected(layers: int = 2) -> dict[str, str]:
    out = {"0.wte": "vocab", "0.wpe": "vocab"}
    for i in range(1, layers + 1):
        out |= {
            f"{i}.attn.q_proj": "colwise",
            f"{i}.attn.k_proj": "colwise",
            f"{i}.attn.v_proj": "colwise",
            f"{i}.attn.out_proj": "rowwise",
            f"{i}.mlp.fc": "colwise",
            f"{i}.mlp.proj": "rowwise",
        }
    return out | {f"{layers + 1}.lm_head": "colwise_gather"}


def test_gpt_block_plan_is_exact() -> None:
    plan = resolve_plan(gpt(layers=2), 2)
    assert styles(plan) == gpt_expected(2)
    assert list(plan.entries) == list(gpt_expected(2)), "entries must follow module order"
    assert plan.notes == {}
    assert {e.source for e in plan.entries.values()} == {"auto"}
    assert plan.entries["1.attn.q_proj"].reason == "q_proj/k_proj/v_proj -> out_proj (attention, 4 heads)"
    assert plan.entries["2.mlp.proj"].reason == "fc -> proj (MLP)"
    assert "leaves the body" in plan.entries["3.lm_head"].reason


def test_manual_attention_like_nanogpt_gives_the_same_plan() -> None:
    assert styles(resolve_plan(gpt(manual=True), 4)) == gpt_expected(2)


def test_mlp_chain_pairs_across_sequential_layers() -> None:
    assert styles(resolve_plan(mlp_chain((8, 16, 16, 8)), 2)) == {"0": "colwise", "2": "rowwise", "4": "colwise_gather"}
    longer = resolve_plan(mlp_chain((8, 16, 16, 16, 16, 8)), 2)
    assert styles(longer) == {"0": "colwise", "2": "rowwise", "4": "colwise", "6": "rowwise", "8": "colwise_gather"}


def test_swiglu_shards_both_gate_projections() -> None:
    plan = resolve_plan(swiglu_model(layers=1), 2)
    assert {k: v for k, v in styles(plan).items() if ".mlp." in k} == {
        "1.mlp.w1": "colwise",
        "1.mlp.w3": "colwise",
        "1.mlp.w2": "rowwise",
    }
    assert plan.entries["1.mlp.w2"].reason == "w1/w3 -> w2 (MLP)"


def test_grouped_query_attention() -> None:
    plan = resolve_plan(gpt(heads=8, kv_heads=4, layers=1), 4)
    assert styles(plan) == gpt_expected(1)
    assert "8 query heads, 4 key/value heads" in plan.entries["1.attn.k_proj"].reason
    with pytest.raises(ValueError, match=r"body\.1\.attn\.k_proj.*key/value heads = 4.*tp values that work: 1, 2, 4\."):
        resolve_plan(gpt(heads=8, kv_heads=4, layers=1), 8)


def test_fused_qkv_is_replicated_with_a_note() -> None:
    plan = resolve_plan(gpt(fused=True, layers=1), 2)
    assert "1.attn.c_attn" not in plan.entries and "1.attn.c_proj" not in plan.entries
    assert "split into parts" in plan.notes["1.attn.c_attn"] and "fused" in plan.notes["1.attn.c_attn"]
    assert "1.attn.c_proj" in plan.notes
    assert styles(plan)["1.mlp.fc"] == "colwise" and styles(plan)["1.mlp.proj"] == "rowwise"


class ResidualMLP(nn.Module):
    """fc's output is needed in full by a residual as well as by proj."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h + self.proj(F.gelu(h))


def test_linear_whose_output_also_feeds_a_residual_is_replicated() -> None:
    plan = resolve_plan(nn.Sequential(ResidualMLP(), nn.Linear(8, 8)), 2)
    assert styles(plan) == {"1": "colwise_gather"}
    assert "residual" in plan.notes["0.fc"] and "residual" in plan.notes["0.proj"]


class GatedMLP(nn.Module):
    """Hidden activations scaled by a learned scalar or by a per-token statistic of the input."""

    def __init__(self, by_param: bool) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(8, 16), nn.Linear(16, 8)
        self.gate = nn.Parameter(torch.ones(1))
        self.by_param = by_param

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.gate if self.by_param else x.mean(-1, keepdim=True)
        return x + self.proj(F.relu(self.fc(x)) * scale)


def test_broadcast_with_an_activation_that_needs_a_gradient_is_refused() -> None:
    # Under TP the statistic's gradient would be a partial sum on each rank (silently wrong), so replicate.
    plan = resolve_plan(nn.Sequential(GatedMLP(by_param=False)), 2)
    assert "0.fc" not in plan.entries and "partial sum" in plan.notes["0.fc"]


def test_a_parameter_meeting_only_sharded_tensors_gets_its_gradient_summed() -> None:
    # a learned gate (or a per-head norm's weight) on the sharded hidden features: the MLP stays sharded and the gate's
    # gradient, each rank's partial sum, is summed over tp
    plan = resolve_plan(nn.Sequential(GatedMLP(by_param=True)), 2)
    assert styles(plan)["0.fc"] == "colwise" and styles(plan)["0.proj"] == "rowwise"
    assert style_kind(plan.entries["0"].style) == "grad_allreduce"
    assert plan.entries["0"].reason.startswith("gradient of gate summed over tp")


class _GateAlsoOnTheInput(GatedMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate + self.proj(F.relu(self.fc(x)) * self.gate)


def test_a_parameter_also_used_on_full_tensors_keeps_the_group_replicated() -> None:
    plan = resolve_plan(nn.Sequential(_GateAlsoOnTheInput(by_param=True)), 2)
    assert "0.fc" not in plan.entries and "0" not in plan.entries
    assert "0.gate" in plan.notes["0.fc"] and "also used on unsharded tensors" in plan.notes["0.fc"]


class RopeAttention(Attention):
    """Rotary embedding (rotate-half) from buffers, as in HF llama."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__(dim, heads)
        freqs = torch.outer(torch.arange(8.0), torch.rand(self.head_dim // 2))
        self.register_buffer("cos", torch.cat([freqs, freqs], -1).cos())
        self.register_buffer("sin", torch.cat([freqs, freqs], -1).sin())

    @staticmethod
    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.size()
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = self.cos[:T], self.sin[:T]
        q, k = (t * cos + self.rotate_half(t) * sin for t in (q, k))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, -1))


def test_rotary_embedding_keeps_attention_sharded() -> None:
    body = nn.Sequential(Embed(32, 8, 16), Block(16, 4, 32, attn=RopeAttention(16, 4)), Head(16, 32))
    assert styles(resolve_plan(body, 2)) == gpt_expected(1)


def test_hard_coded_head_count_is_caught_by_the_local_shape_simulation() -> None:
    # `view(B, T, 4, -1)` with counts that are no head-count attribute of the module: nothing to set per rank
    body = nn.Sequential(Embed(32, 8, 16), Block(16, 4, 32, attn=Attention(16, 4, hard_coded="literal")), Head(16, 32))
    plan = resolve_plan(body, 2)
    for name in ("", ".q_proj", ".k_proj", ".v_proj", ".out_proj"):
        assert f"1.attn{name}" not in plan.entries
    assert "hard-coded number of heads" in plan.notes["1.attn.q_proj"] and "-1" in plan.notes["1.attn.q_proj"]
    assert styles(plan)["1.mlp.fc"] == "colwise", "the MLP must not be blamed"


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(4, 4, 2), (4, 4, 4), (8, 4, 2), (8, 2, 2)])
def test_attention_viewing_by_its_head_count_attributes_gets_them_per_rank(heads: int, kv_heads: int, tp: int) -> None:
    # OPT's `view(bsz, -1, self.num_heads, self.head_dim)`, StableLM's `view(bsz, q_len, self.num_heads, ...)`
    body = gpt(dim=16, heads=heads, kv_heads=kv_heads, layers=2, hard_coded="attr")
    plan = resolve_plan(body, tp)
    expected = gpt_expected(2)
    for i in (1, 2):
        expected = {**expected, f"{i}.attn": "heads"}
    got = {k: style_kind(e.style) for k, e in plan.entries.items()}
    assert got == {k: expected[k] for k in got} and got.keys() == expected.keys(), plan.notes
    style = plan.entries["1.attn"].style
    assert isinstance(style, LocalHeadCounts) and style.counts == {"heads": heads, "kv_heads": kv_heads}
    assert style.local_counts(tp) == {"heads": heads // tp, "kv_heads": kv_heads // tp}
    assert plan.entries["1.attn"].reason.startswith(f"heads {heads} -> {heads // tp}, kv_heads {kv_heads} -> ")
    attn = body[1].attn
    assert (attn.heads, attn.kv_heads) == (heads, kv_heads), "the analysis must restore the model's attributes"
    table = describe_plan(body, plan, tp)
    assert "body.1.attn  " in table and " heads " in table and f"{len(expected) - 2} modules sharded" in table


class _ReshapeByInput(nn.Module):
    """nanoGPT-like: the head size comes from the input's full width, so a per-rank head count cannot fix it."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.n_head = heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = (p(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for p in
                   (self.q_proj, self.k_proj, self.v_proj))  # fmt: skip
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, C))


def test_head_counts_that_do_not_fix_the_local_shapes_leave_the_attention_replicated() -> None:
    body = nn.Sequential(Embed(32, 8, 16), Block(16, 4, 32, attn=_ReshapeByInput(16, 4)), Head(16, 32))
    plan = resolve_plan(body, 2)
    assert not {"1.attn", "1.attn.q_proj", "1.attn.out_proj"} & plan.entries.keys()
    assert "1.attn.q_proj" in plan.notes and body[1].attn.n_head == 4
    assert styles(plan)["1.mlp.fc"] == "colwise"


def test_head_count_attributes_are_found_by_name_and_value() -> None:
    body = gpt(dim=16, heads=4, layers=1, hard_coded="attr")
    attn = body[1].attn
    attn.head_dim, attn.num_heads_flag, attn.n_heads_scale = 4, True, 4  # a size, a bool, a scale: never counts
    members = [f"1.attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "out_proj")]
    assert head_counts(body, members, {4}, 2) == {"1.attn": {"heads": 4, "kv_heads": 4}}
    assert head_counts(body, members, {8}, 2) == {}, "a value that is not one of the group's head counts"
    assert head_counts(body, members, {4}, 8) == {}, "a count tp does not divide"


class _Mesh:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def test_local_head_counts_style_sets_checks_and_is_idempotent() -> None:
    attn = Attention(16, 4, kv_heads=2, hard_coded="attr")
    style = LocalHeadCounts({"heads": 4, "kv_heads": 2})
    assert style_kind(style) == "heads" and "kv_heads" in repr(style)
    style._apply(attn, _Mesh(2))  # type: ignore[arg-type]
    assert (attn.heads, attn.kv_heads) == (2, 1)
    style._apply(attn, _Mesh(2))  # type: ignore[arg-type]  # a second parallelize_module: unchanged
    assert (attn.heads, attn.kv_heads) == (2, 1)
    with pytest.raises(ValueError, match="not divisible by tp=4"):
        LocalHeadCounts({"kv_heads": 2})._apply(Attention(16, 4, kv_heads=2), _Mesh(4))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Attention\.heads is 8, expected 4"):
        LocalHeadCounts({"heads": 4})._apply(Attention(16, 8), _Mesh(2))  # type: ignore[arg-type]


def test_heads_not_divisible_raises_with_working_tp_values() -> None:
    with pytest.raises(
        ValueError,
        match=r"body\.1\.attn\.q_proj.*attention heads = 6.*tp=4.*"
        r"tp values that work: 1, 2, 3, 6\.",
    ):
        resolve_plan(gpt(dim=24, heads=6, hidden=48), 4)


def test_ffn_not_divisible_raises_with_working_tp_values() -> None:
    with pytest.raises(
        ValueError,
        match=r"body\.1\.mlp\.fc .*MLP hidden size \(out_features\) = 30 .*tp=4.*"
        r"tp values that work: 1, 2, 3, 5, 6, 10, 15, 30\.",
    ):
        resolve_plan(gpt(hidden=30), 4)


def test_classifier_head_not_divisible_is_left_replicated_with_a_note() -> None:
    plan = resolve_plan(mlp_chain((8, 16, 16, 10)), 4)
    assert styles(plan) == {"0": "colwise", "2": "rowwise"}
    assert "10 outputs" in plan.notes["4"] and "tp=4" in plan.notes["4"] and "1, 2, 5, 10" in plan.notes["4"]
    assert styles(resolve_plan(mlp_chain((8, 16, 16, 10)), 2))["4"] == "colwise_gather"


def test_vocab_not_divisible_is_left_replicated_with_a_note() -> None:
    plan = resolve_plan(gpt(vocab=30), 4)
    assert "0.wte" not in plan.entries and "30 embeddings" in plan.notes["0.wte"]
    assert "3.lm_head" not in plan.entries and "30 outputs" in plan.notes["3.lm_head"]
    assert styles(plan)["0.wpe"] == "vocab"


def test_tied_embedding_and_head_are_left_replicated() -> None:
    body = gpt(layers=1)
    body[2].lm_head.weight = body[0].wte.weight
    plan = resolve_plan(body, 2)
    assert "0.wte" not in plan.entries and "2.lm_head" not in plan.entries
    assert "tied" in plan.notes["0.wte"] and "tied" in plan.notes["2.lm_head"]


def test_multihead_attention_module_is_left_alone() -> None:
    class MHA(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 4, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.attn(x, x, x, need_weights=False)[0]

    plan = resolve_plan(nn.Sequential(Embed(32, 8, 16), MHA(), Head(16, 32)), 2)
    note = plan.notes["1.attn.out_proj"]
    assert "1.attn.out_proj" not in plan.entries and "multi_head_attention_forward" in note


def test_analysis_runs_on_the_meta_device() -> None:
    with torch.device("meta"):
        body = gpt(layers=2)
    plan = resolve_plan(body, 2)
    assert styles(plan) == gpt_expected(2)
    assert all(p.is_meta for p in body.parameters())


def test_module_rng_and_modes_are_unchanged() -> None:
    torch.manual_seed(0)
    body = gpt(layers=1)
    body.train()
    before = {k: v.clone() for k, v in body.state_dict().items()}
    rng = torch.get_rng_state()
    resolve_plan(body, 2)
    after = body.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(m.training for m in body.modules())
    for m in body.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks, f"hook left on {m}"
    assert torch._C._len_torch_function_stack() == 0


def test_a_body_the_analysis_cannot_run_warns_and_keeps_explicit_entries() -> None:
    class NeedsTwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("needs a mask")

    body = nn.Sequential(NeedsTwoInputs(), nn.Linear(8, 8))
    with pytest.warns(UserWarning, match="could not run the body.*needs a mask"):
        plan = resolve_plan(body, 2, explicit={"body.1": "rowwise"})
    assert styles(plan) == {"1": "rowwise"}
    assert "0.fc" in plan.notes


def test_explicit_replicate_lets_the_next_pair_form() -> None:
    plan = resolve_plan(mlp_chain((8, 16, 16, 16, 8)), 2, explicit={"body.0": "replicate"})
    assert styles(plan) == {"0": "replicate", "2": "colwise", "4": "rowwise", "6": "colwise_gather"}
    assert plan.entries["0"].source == "explicit" and plan.entries["2"].source == "auto"


class UsesWeightDirectly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.relu(self.fc(x))) + F.linear(x, self.fc.weight).mean(-1, keepdim=True)


def test_weight_used_outside_its_module_is_left_replicated() -> None:
    plan = resolve_plan(nn.Sequential(UsesWeightDirectly()), 2)
    assert "0.fc" not in plan.entries and "outside its own forward" in plan.notes["0.fc"]


def test_body_starting_with_a_linear_on_sequences_is_analysed() -> None:
    # example_input_for gives (1, in_features); `B, T, C = x.size()` needs (1, T, C): the analysis retries.
    body = nn.Sequential(InOut(16), Block(16, 4, 32), Head(16, 8))
    plan = resolve_plan(body, 2)
    assert {k: v for k, v in styles(plan).items() if k.startswith("1.")} == {
        k: v for k, v in gpt_expected(1).items() if k.startswith("1.")
    }
    assert styles(plan)["2.lm_head"] == "colwise_gather"


def test_last_linear_is_gathered_even_when_ops_follow_it() -> None:
    body = nn.Sequential(*mlp_chain((8, 16, 16, 10)), nn.LogSoftmax(-1))  # softmax over the classes
    assert styles(resolve_plan(body, 2)) == {"0": "colwise", "2": "rowwise", "4": "colwise_gather"}


@pytest.mark.parametrize(
    ("in_shape", "out_shape", "dim", "expected"),
    [
        ((1, 2, 16), (1, 2, 4, 4), 2, (2, 4)),  # (B, T, C) -> (B, T, heads, head_dim): sharded on heads
        ((1, 4, 2, 4), (1, 4, 8), 1, (1, 4)),  # view that keeps heads outermost
        ((1, 2, 4, 4), (1, 2, 16), 2, (2, 16)),  # merge heads back
        ((2, 16), (2, 1, 16), 1, (2, 16)),  # unsqueeze
    ],
)
def test_view_rule_follows_the_sharded_dimension(in_shape, out_shape, dim, expected) -> None:  # type: ignore[no-untyped-def]
    assert map_view(in_shape, out_shape, dim) == expected


def test_view_and_index_rules_refuse_what_breaks_contiguous_blocks() -> None:
    with pytest.raises(Refuse, match="merged with the dimensions before it"):
        map_view((2, 16), (32,), 1)  # flattening (T, C) interleaves the ranks' blocks
    assert map_getitem((Ellipsis, slice(None, 2)), (1, 4, 2, 4), 1) == 1
    assert map_getitem((0, None), (4, 16), 1) == 1
    with pytest.raises(Refuse, match="split into parts"):
        map_getitem((slice(None), slice(0, 8)), (2, 16), 1)


PAIR = {"*.attn.[qkv]_proj": "colwise", "*.attn.out_proj": "rowwise"}


def test_an_explicit_attention_plan_gets_the_head_counts_and_the_summed_norm_gradients_too() -> None:
    body = gpt(dim=16, heads=4, kv_heads=2, layers=1, hard_coded="attr", qk_norm=True)
    plan = resolve_plan(body, 2, explicit=PAIR)
    assert plan.entries["1.attn.q_proj"].source == "explicit"
    assert plan.entries["1.attn"].style.counts == {"heads": 4, "kv_heads": 2}  # type: ignore[union-attr]
    assert style_kind(plan.entries["1.attn.q_norm"].style) == style_kind(plan.entries["1.attn.k_norm"].style)
    assert style_kind(plan.entries["1.attn.k_norm"].style) == "grad_allreduce"
    kept = resolve_plan(body, 2, explicit={**PAIR, "*.attn.q_norm": "replicate"})
    assert "1.attn.q_norm" in kept.entries and kept.entries["1.attn.q_norm"].style == "replicate", "the user's wins"


def test_an_explicit_attention_plan_that_gives_wrong_shapes_is_kept_with_a_warning() -> None:
    body = gpt(dim=16, heads=4, layers=1, hard_coded="literal")
    with pytest.warns(UserWarning, match=r"explicit tensor-parallel plan shards body\.1\.attn\.k_proj/.*wrong numbers"):
        plan = resolve_plan(body, 2, explicit=PAIR)
    assert styles(plan)["1.attn.q_proj"] == "colwise" and "1.attn" not in plan.entries
    assert styles(plan)["1.mlp.fc"] == "colwise", "the analysis goes on for the rest"


class _MatmulLinear(nn.Linear):
    """Falcon's FalconLinear: the same function as nn.Linear, written out."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out = input @ self.weight.T
        return out if self.bias is None else out + self.bias


class _ScaledLinear(nn.Linear):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(input)


class _Broken(nn.Linear):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no")


def test_a_linear_subclass_computing_what_linear_does_is_planned_as_one() -> None:
    assert acts_as_linear(_MatmulLinear(4, 6)) and acts_as_linear(_MatmulLinear(4, 6, bias=False))
    assert not acts_as_linear(_ScaledLinear(4, 6)) and not acts_as_linear(_Broken(4, 6))
    assert not acts_as_linear(nn.Embedding(4, 6))
    with torch.device("meta"):
        assert acts_as_linear(_MatmulLinear(4, 6)), "the probe runs on the CPU whatever the module's device"
    mlp = nn.Sequential(_MatmulLinear(8, 16), nn.ReLU(), _MatmulLinear(16, 8))
    assert styles(resolve_plan(mlp, 2, example_input=torch.zeros(1, 8))) == {"0": "colwise", "2": "rowwise"}
    other = resolve_plan(nn.Sequential(_ScaledLinear(8, 16), nn.ReLU(), nn.Linear(16, 8)), 2)
    assert "with its own forward" in other.notes["0"]


def test_an_output_modified_in_place_is_copied() -> None:
    body = nn.Sequential(Embed(32, 8, 16), Block(16, 4, 32, inplace=True), Head(16, 32))
    plan = resolve_plan(body, 2)
    assert plan.copied == {"1.mlp.proj"}, "the row-parallel output the block adds its residual into"
    assert styles(plan)["1.mlp.proj"] == "rowwise" and "output copied (modified in place by `add`" in (
        plan.entries["1.mlp.proj"].reason
    )
    made = plan.styles_for("1")
    assert isinstance(made["mlp.proj"], CopiedOutput) and closes_region(made["mlp.proj"])
    assert not isinstance(made["mlp.fc"], CopiedOutput) and opens_region(made["mlp.fc"])
    assert resolve_plan(gpt(layers=1), 2).copied == set()
