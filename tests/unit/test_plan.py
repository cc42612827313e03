"""The planner's memory and time formulas against hand-computed values for a tiny model, the model description
against the example models' real parameter counts, ranking sanity, and the messages for bad input."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_3d.plan import ClusterSpec, Layout, ModelSpec, NoLayout, Search, evaluate, load_cluster, plan
from lightning_3d.plan.layouts import enumerate_layouts, min_micro_batches, unsupported_reason
from lightning_3d.plan.memory import in_flight, layout_memory
from lightning_3d.plan.model import model_from_config
from lightning_3d.plan.timing import allreduce_s, step_time

# 2 layers, hidden 8, ffn 32, 2 heads, vocabulary 16, sequence 4, no biases.
TINY = ModelSpec(name="t", n_layer=2, hidden=8, ffn=32, n_head=2, n_kv_head=2, vocab=16, seq_len=4)
# An ideal machine: 1 GFLOP/s at every size, no overheads, free and instant communication.
IDEAL = ClusterSpec(
    name="ideal",
    gpus_per_node=8,
    nodes=1,
    peak_flops=1e9,
    memory_gib=1.0,
    reserved_gib=0.0,
    intra_bw_gbs=1e9,
    inter_bw_gbs=1e9,
    intra_latency_s=0.0,
    inter_latency_s=0.0,
    mem_bw_gbs=1e12,
    matmul_eff_max=1.0,
    matmul_half_size=0.0,
    op_overhead_s=0.0,
    step_overhead_s=0.0,
    micro_batch_overhead_s=0.0,
    dp_overlap=0.0,
    precision="32-true",
)


def test_tiny_model_counts_by_hand():
    # qkv 8x24 + out 8x8 + fc 8x32 + proj 32x8 = 768 matrix entries, two norm weights of 8.
    assert TINY.layer_params() == 768 + 16
    assert TINY.params() == 2 * 784 + 16 * 8 + (8 + 16 * 8)
    # Forward per token and layer: 2 x 768 (matmuls) + 2 x 2 x seq 4 x hidden 8 (attention) = 1664; head 2 x 8 x 16.
    assert TINY.layer_forward_flops(1) == 1664
    assert TINY.flops_per_token() == 3 * (2 * 1664 + 256)


def test_model_description_matches_the_example_models():
    from lightning_3d.plan.model import GPT_PRESETS
    from lightning_3d_examples.gpt import GPT, PRESETS

    for name, shape in GPT_PRESETS.items():
        p = PRESETS[name]
        assert shape == dict(block_size=p.block_size, n_layer=p.n_layer, n_head=p.n_head, n_embd=p.n_embd), name
    gpt = GPT("small", n_layer=3)
    gpt.configure_model()
    assert model_from_config({"preset": "small", "n_layer": 3}).params() == sum(p.numel() for p in gpt.parameters())


def test_hugging_face_config_parameters_match_transformers():
    transformers = pytest.importorskip("transformers")
    fields = dict(
        num_hidden_layers=3,
        hidden_size=64,
        intermediate_size=172,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=300,
    )
    config = transformers.LlamaConfig(**fields, tie_word_embeddings=False)
    real = sum(p.numel() for p in transformers.LlamaForCausalLM(config).parameters())
    spec = model_from_config({**fields, "block_size": 32})
    assert spec.gated_mlp and spec.n_kv_head == 2
    assert spec.params() == real


def test_memory_by_hand():
    lay = Layout(tp=1, pp=1, dp=1, micro_batches=1, micro_batch_size=2)
    mem = layout_memory(TINY, IDEAL, lay)
    params = TINY.params()
    assert (mem.weights, mem.gradients, mem.optimizer) == (4 * params, 4 * params, 8 * params)
    # Per token and layer 4h + (2h + 2 kv + 2 ffn) = 32 + 96 = 128 fp32 elements; 8 tokens, 2 layers, one in flight;
    # logits 8 x 16 x (4 + 4 fp32 log-probabilities) kept, and their gradient.
    assert mem.activations == 2 * 128 * 8 * 4 + 2 * 8 * 16 * 8
    assert mem.buffers == 0 and mem.reserved == 0
    # Full checkpointing keeps the blocks' inputs (h per token) and one block's activations.
    ac = layout_memory(TINY, IDEAL, dataclasses.replace(lay, activation_checkpointing="full"))
    assert ac.activations == 2 * 8 * 8 * 4 + 128 * 8 * 4 + 2 * 8 * 16 * 8
    # FSDP shards the states over dp.
    fsdp = layout_memory(TINY, IDEAL, Layout(1, 1, 4, 1, 2, data_parallel="fsdp"))
    assert fsdp.optimizer == 8 * params / 4


def test_micro_batches_in_flight_per_schedule():
    assert in_flight(Layout(1, 4, 1, 8, 1, "gpipe"), 0) == 8
    assert [in_flight(Layout(1, 4, 1, 8, 1, "1f1b"), r) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight(Layout(1, 4, 1, 2, 1, "1f1b"), 0) == 2
    # Interleaved with 2 stages per rank, rank 0 from m = 2 pp on: pp + (pp - 1) / v = 4 + 3/2; the last rank
    # holds far fewer (its warm-up is (v - 1) pp forwards of half a stage each, plus one).
    interleaved = [in_flight(Layout(1, 4, 1, 8, 1, "interleaved1f1b", 2), r) for r in range(4)]
    assert interleaved == pytest.approx([5.5, 4.5, 3.5, 2.5])


def test_interleaved_in_flight_matches_torchs_action_lists():
    """The planner's interleaved-1F1B count per rank (stage-equivalents) against the most micro-batches the rank
    holds at one time on torch's own action list: a chunk's forward adds one, its backward frees it (no split
    backward here, so the list is what memory sees: benchmark B3 measures it exactly)."""
    from lightning_3d.core.pipeline import micro_batch_problem, schedule_actions

    checked = 0
    for v in (2, 3):
        for pp in (2, 3, 4, 8):
            for m in (pp, 2 * pp, 3 * pp, 4 * pp, pp + 1):
                if micro_batch_problem("interleaved1f1b", pp, m) or m % max(1, m // pp):
                    continue
                order = schedule_actions("interleaved1f1b", pp, v, m)
                for r in range(pp):
                    live = peak = 0
                    for action in order[r]:
                        kind = None if action is None else str(action.computation_type.value)
                        live += {"F": 1, "B": -1}.get(kind, 0)
                        peak = max(peak, live)
                    assert in_flight(Layout(1, pp, 1, m, 1, "interleaved1f1b", v), r) == peak / v, (v, pp, m, r)
                checked += 1
    assert checked >= 16


@pytest.mark.parametrize("schedule", ["zbvzerobubble", "interleavedzerobubble"])
def test_zero_bubble_in_flight_matches_torchs_action_lists(schedule):
    """The planner's count for the zero-bubble schedules (stage-equivalents per rank) against the micro-batches
    each stage holds on torch's own action list (the strategy's count), for several pp and m (pp dividing m)."""
    from lightning_3d.core.pipeline import activations_in_flight, micro_batch_problem, stage_ranks

    checked = 0
    for pp in (2, 3, 4, 8):
        for m in (pp, 2 * pp, 3 * pp, 4 * pp):
            if micro_batch_problem(schedule, pp, m):
                continue
            held = activations_in_flight(schedule, pp, 2, m)
            placement = stage_ranks(schedule, pp, 2)
            for r in range(pp):
                per_rank = sum(held[s] for s in range(2 * pp) if placement[s] == r) / 2  # half a rank's layers each
                assert in_flight(Layout(1, pp, 1, m, 1, schedule, 2), r) == per_rank, (pp, m, r)
            checked += 1
    assert checked >= 8


def test_zero_bubble_over_one_stage_per_rank_is_a_layout_and_holds_what_its_action_list_says():
    """ZB-H1 (``interleavedzerobubble`` over one stage per rank): enumerated beside the two-stage form, named apart
    (``:1``), and counted at ``min(m, pp)`` in flight on every rank: the most micro-batches between a forward and
    its ``W`` on torch's own action list (the strategy's count); its fill is the forwards' alone, as for ZB1P."""
    from lightning_3d.core.pipeline import activations_in_flight, micro_batch_problem

    checked = 0
    for pp in (2, 3, 4, 8):
        for m in (pp, 2 * pp, 3 * pp, pp + 1):
            if micro_batch_problem("interleavedzerobubble", pp, m):
                continue
            held = activations_in_flight("interleavedzerobubble", pp, 1, m)
            for r in range(pp):
                assert in_flight(Layout(1, pp, 1, m, 1, "interleavedzerobubble", 1), r) == held[r], (pp, m, r)
            checked += 1
    assert checked >= 10
    lays = list(enumerate_layouts(TINY, IDEAL, 16, Search(tp=[1], pp=[2], data_parallel=["replicate"])))
    zb = {(lay.micro_batches, lay.stages_per_rank) for lay in lays if lay.schedule == "interleavedzerobubble"}
    # dp 4 (8 devices), replica batch 4: m = 4 or 2 (1 is under pp); two stages per rank would need 4 layers, not 2
    assert zb == {(4, 1), (2, 1)}
    one = Layout(1, 2, 8, 8, 1, "interleavedzerobubble", 1)
    assert one.short() == "tp1 pp2 dp8 m8x1 interleavedzerobubble:1"
    f1b, zbh1 = step_time(TINY, IDEAL, Layout(1, 2, 1, 8, 1)), step_time(TINY, IDEAL, one)
    assert zbh1.bubble < f1b.bubble


def test_the_planners_schedule_tables_are_the_strategys():
    """The planner spells its schedule rules out (it imports nothing from the strategy); they must be the
    strategy's: which schedules run several stages per rank, and which of those also run over one."""
    from lightning_3d.core import pipeline
    from lightning_3d.plan.layouts import MULTI_STAGE, SCHEDULES, STAGE_COUNTS

    assert {s for s in SCHEDULES if pipeline.is_multi_stage(s)} == set(MULTI_STAGE)
    assert {s for s, counts in STAGE_COUNTS.items() if 1 in counts} == set(pipeline.ONE_STAGE_PER_RANK_TOO) & set(
        SCHEDULES
    )
    for schedule in SCHEDULES:  # both take the same fewest micro-batches at one stage per rank
        for pp in (1, 2, 4):
            if schedule not in MULTI_STAGE or 1 in STAGE_COUNTS.get(schedule, ()):
                assert min_micro_batches(schedule, pp) == pipeline.min_micro_batches(schedule, pp), (schedule, pp)


def test_step_time_by_hand():
    # At 100% efficiency and free communication one step is the model's FLOPs over the peak.
    lay = Layout(tp=1, pp=1, dp=1, micro_batches=1, micro_batch_size=2)
    assert step_time(TINY, IDEAL, lay).total == pytest.approx(TINY.flops_per_token() * 8 / 1e9)
    # GPipe over 2 ranks, 4 micro-batches of 2: rank 0 = one block (3 x 13312 FLOPs), rank 1 = one block and the
    # head (39936 + 3 x 2048): (m - 1) x slowest + sum over ranks.
    gpipe = step_time(TINY, IDEAL, Layout(1, 2, 1, 4, 2, "gpipe"))
    assert gpipe.total == pytest.approx((3 * 46080 + 39936 + 46080) / 1e9)
    assert gpipe.bubble == pytest.approx(39936 / 1e9)
    # The efficiency curve: a product whose smallest size equals matmul_half_size runs at half the rate.
    half = dataclasses.replace(IDEAL, matmul_half_size=8.0)
    assert half.matmul_efficiency(8) == pytest.approx(0.5)
    # Ring all-reduce: 2 (n - 1) / n x bytes / bandwidth + 2 (n - 1) x latency.
    assert allreduce_s(1000, 4, 100.0, 0.5) == pytest.approx(1.5 * 10 + 3.0)


def test_tp_and_dp_communication_are_charged():
    slow = dataclasses.replace(IDEAL, intra_bw_gbs=1e-3, intra_latency_s=1e-4)
    tp2 = step_time(TINY, slow, Layout(2, 1, 1, 1, 2))
    # 4 all-reduces per block of 8 tokens x 8 fp32 per micro-batch, the embedding's, and the gathered logits.
    boundary = 8 * 8 * 4
    expected = 2 * 4 * allreduce_s(boundary, 2, 1e6, 1e-4) + allreduce_s(boundary, 2, 1e6, 1e-4)
    expected += 2 * (0.5 * 8 * 16 * 4 / 1e6 + 1e-4)
    assert tp2.tp_comm == pytest.approx(expected)
    dp2 = step_time(TINY, slow, Layout(1, 1, 2, 1, 2))
    assert dp2.dp_comm == pytest.approx(allreduce_s(TINY.params() * 4, 2, 1e6, 1e-4))


def test_shared_cores_make_the_step_the_total_work():
    shared = dataclasses.replace(IDEAL, cores=1)
    alone = step_time(TINY, IDEAL, Layout(1, 1, 2, 1, 2)).total
    # Two replicas on one core take twice as long as on two devices.
    assert step_time(TINY, shared, Layout(1, 1, 2, 1, 2)).total == pytest.approx(2 * alone)


def test_shared_latency_applies_only_when_processes_outnumber_cores():
    slow = dataclasses.replace(IDEAL, intra_bw_gbs=1e-3, intra_latency_s=1e-4, shared_latency_s={8: 1e-3})
    # dedicated devices (cores None) and enough cores: the link's own latency
    assert slow.latency(1e-4, 2, 2) == 1e-4
    assert dataclasses.replace(slow, cores=4).latency(1e-4, 2, 2) == 1e-4
    oversubscribed = dataclasses.replace(slow, cores=1)
    assert oversubscribed.latency(1e-4, 2, 2) == 1e-3  # the next measured size up (8)
    assert oversubscribed.latency(1e-4, 2, 1) == 1e-4  # no message within a group of one
    table = dataclasses.replace(oversubscribed, shared_latency_s={2: 5e-4, 8: 2e-3})
    assert (table.latency(1e-4, 8, 2), table.latency(1e-4, 8, 4), table.latency(1e-4, 8, 16)) == (5e-4, 2e-3, 2e-3)
    # the data-parallel all-reduce of two replicas on one core pays the shared latency per message
    dp2 = step_time(TINY, oversubscribed, Layout(1, 1, 2, 1, 2))
    assert dp2.dp_comm == pytest.approx(allreduce_s(TINY.params() * 4, 2, 1e6, 1e-3))


def test_background_load_counts_running_tasks_not_the_lagging_average(tmp_path, monkeypatch):
    from lightning_3d.plan import calibrate

    loadavg = tmp_path / "loadavg"
    loadavg.write_text("30.00 20.00 10.00 3/400 12345\n")  # load average 30 (lagging), 3 running now
    real_path = calibrate.Path
    monkeypatch.setattr(calibrate, "Path", lambda p: loadavg if p == "/proc/loadavg" else real_path(p))
    assert calibrate.background_load(seconds=0.01, samples=3) == 2.0  # less the sampling process itself


def test_ranking_sanity():
    h100 = load_cluster("h100_80g")
    gpt = model_from_config({"preset": "xl", "vocab_size": 50304})
    result = plan(gpt, h100, 64, features=frozenset())
    steps = [e.step_s for e in result.entries]
    assert steps == sorted(steps)
    assert all(e.memory.gib <= h100.memory_gib for e in result.entries)
    assert 0.2 < result.best.mfu < 0.8
    # More micro-batches shrink the bubble; interleaving shrinks it further.
    bubbles = [
        step_time(gpt, h100, Layout(1, 4, 2, m, 32 // m, "1f1b")).bubble
        / step_time(gpt, h100, Layout(1, 4, 2, m, 32 // m, "1f1b")).total
        for m in (4, 8, 16, 32)
    ]
    assert bubbles == sorted(bubbles, reverse=True)
    one = step_time(gpt, h100, Layout(1, 4, 2, 8, 4, "1f1b"))
    inter = step_time(gpt, h100, Layout(1, 4, 2, 8, 4, "interleaved1f1b", 2))
    assert inter.bubble < one.bubble
    # Tensor parallelism never leaves a node, and splits heads evenly.
    assert all(e.layout.tp <= 8 and gpt.n_head % e.layout.tp == 0 for e in result.entries)


def test_unsupported_layouts_are_marked():
    assert unsupported_reason(Layout(1, 1, 2, 1, 1, data_parallel="fsdp"), frozenset()) is not None
    assert unsupported_reason(Layout(1, 1, 2, 1, 1, data_parallel="fsdp"), frozenset({"data_parallel"})) is None
    assert unsupported_reason(Layout(1, 2, 1, 2, 1, "zbvzerobubble", 2), frozenset({"data_parallel"})) is not None
    assert unsupported_reason(Layout(1, 2, 1, 2, 1, "interleaved1f1b", 2), frozenset()) is None
    result = plan(TINY, IDEAL, 8, features=frozenset())
    assert result.best_runnable() is not None and result.best_runnable().runnable


def test_search_pins():
    lays = list(enumerate_layouts(TINY, IDEAL, 16, Search(tp=[2], data_parallel=["replicate"])))
    assert lays and all(lay.tp == 2 and lay.data_parallel == "replicate" for lay in lays)
    with pytest.raises(ValueError, match=r"search\.schedule"):
        Search(schedule=["1f2b"])


def test_a_model_that_fits_nowhere_gets_memory_needed_and_the_knob():
    big = model_from_config(
        {
            "num_hidden_layers": 126,
            "hidden_size": 16384,
            "intermediate_size": 53248,
            "num_attention_heads": 128,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "block_size": 8192,
        }
    )
    with pytest.raises(NoLayout, match=r"needs [\d.]+ GiB per device.*What helps most: cluster.nodes=\d+, the fewest"):
        plan(big, load_cluster("h100_80g"), 16, features=frozenset())
    # With recomputation pinned off, unpinning it is what helps most.
    long = dataclasses.replace(TINY, seq_len=32768, hidden=64, ffn=256, vocab=64)
    small = dataclasses.replace(IDEAL, memory_gib=0.2, gpus_per_node=1)
    with pytest.raises(NoLayout, match=r"What helps most: unpin search\.activation_checkpointing"):
        plan(long, small, 1, Search(activation_checkpointing=["none"]), features=frozenset())


def test_unknown_cluster_lists_the_known_ones():
    with pytest.raises(ValueError, match="known clusters: a100_80g, cpu8, h100_80g, h200"):
        load_cluster("tpu_v5")


def test_a_global_batch_no_layout_divides_gets_the_nearest():
    # tp <= 2 (heads) and pp <= 2 (layers) leave dp >= 2 of 8 devices: an odd batch divides no layout.
    with pytest.raises(NoLayout, match="nearest that work: 6 and 8"):
        plan(TINY, IDEAL, 7, features=frozenset())


def test_entry_json_has_the_required_fields():
    entry = evaluate(TINY, IDEAL, Layout(1, 2, 4, 2, 1, "1f1b"))
    record = entry.as_dict()
    for key in (
        "tp",
        "pp",
        "dp",
        "micro_batches",
        "micro_batch_size",
        "schedule",
        "data_parallel",
        "activation_checkpointing",
        "memory_gib",
        "step_s",
        "tflops_per_gpu",
    ):
        assert key in record


def test_fsdp_under_a_pipeline_gathers_once_per_step():
    from lightning_3d.plan.memory import rank_params, rank_shapes
    from lightning_3d.plan.timing import gather_s

    slow = dataclasses.replace(IDEAL, intra_bw_gbs=1e-3, intra_latency_s=1e-4)
    lay = Layout(1, 2, 4, 4, 1, "1f1b", data_parallel="fsdp")
    shapes = rank_shapes(TINY, lay)
    # Rank 1 (a block and the head) is the slowest; its parameters are gathered (fp32 here) and its fp32
    # gradients reduce-scattered once per step, whatever the micro-batch count.
    params = rank_params(TINY, lay, shapes[1])
    want = gather_s(params * 4, 4, 1e6, 1e-4) + gather_s(params * 4, 4, 1e6, 1e-4)
    assert step_time(TINY, slow, lay).dp_comm == pytest.approx(want)
    assert step_time(
        TINY, slow, dataclasses.replace(lay, micro_batches=2, micro_batch_size=2)
    ).dp_comm == pytest.approx(want)
    # Memory: the states sharded over dp, the stage's gathered parameters and gradients kept for the step.
    mem = layout_memory(TINY, IDEAL, lay)
    held = rank_params(TINY, lay, shapes[mem.rank])
    assert mem.weights == pytest.approx(held * 4 / 4) and mem.optimizer == pytest.approx(held * 8 / 4)
    # Send/receive buffers (2 x 2 x 4 tokens x 8 fp32) and the gathered fp32 parameters and gradients.
    assert mem.buffers == pytest.approx(4 * 4 * 8 * 4 + held * (4 + 4))


def test_reasons_name_the_difference_and_the_part_that_wins():
    from lightning_3d.plan.report import reason

    slow_link = dataclasses.replace(IDEAL, intra_bw_gbs=1e-4)
    a = evaluate(TINY, slow_link, Layout(1, 1, 2, 1, 4))
    b = evaluate(TINY, slow_link, Layout(2, 1, 1, 1, 8))
    text = reason(a, b) if a.step_s < b.step_s else reason(b, a)
    assert "tp 1 vs 2" in text or "tp 2 vs 1" in text
    assert "tensor-parallel all-reduces" in text or "data-parallel gradient exchange" in text
