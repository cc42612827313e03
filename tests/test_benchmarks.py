"""The benchmarks' plumbing, at a tiny size and without timing anything.

B5 (communication audit), B4 (state bytes) and B3 (saved-tensor bytes) are pure counts, so at any size they
must match their formulas; they run as ``python -m benchmarks ID --tiny`` through the harness with a hard time
limit. The timed benchmarks (B0, B1, B2, B6, B7) are only checked for their interface here.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

from launch import ROOT, run_lightning


def _import(name: str) -> ModuleType:
    """Import a module of the ``benchmarks`` package (at the repository root, not installed)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(name)


def _bench(tmp_path, *ids: str, timeout: float = 240) -> dict[str, dict]:
    run_lightning("bench_run.py", [*ids, "--tiny", "--out", tmp_path], timeout=timeout)
    return {i: json.loads((tmp_path / f"{i}.json").read_text()) for i in ids}


def _check_keys(record: dict) -> None:
    for key in ("measured", "baseline", "ideal", "ratio", "environment", "details"):
        assert key in record, key
    env = record["environment"]
    assert env["cpu_count"] and env["torch"] and isinstance(env["loadavg_start"], list)


@pytest.mark.slow
def test_b5_communication_counts_match_the_formulas(tmp_path):
    record = _bench(tmp_path, "B5")["B5"]
    _check_keys(record)
    checks = record["details"]["checks"]
    assert record["details"]["unexplained_in_schedule"] == []
    for name in (
        "p2p elements per boundary",
        "p2p calls per boundary",
        "TP all-reduces per layer per micro-batch (fwd)",
        "TP all-reduce elements (fwd)",
        "TP all-reduce elements (bwd)",
        "TP all-reduces per layer per micro-batch (bwd)",
        "TP embedding all-reduces per micro-batch (fwd)",
        "TP embedding all-reduce elements per micro-batch",
        "TP head all-gathers per micro-batch (fwd)",
        "TP head all-gather input elements",
        "TP head all-reduces per micro-batch (bwd)",
        "DDP all-reduce calls per step",
        "DDP all-reduce elements",
    ):
        assert checks[name]["ratio"] == 1.0, (name, checks[name])
    # Backward: Megatron's 2 per layer although q, k and v are separate Linears (they share one input conversion).
    assert checks["TP all-reduces per layer per micro-batch (bwd)"]["measured"] == 2.0


@pytest.mark.slow
def test_b4_state_bytes_are_exactly_the_share(tmp_path):
    record = _bench(tmp_path, "B4")["B4"]
    _check_keys(record)
    ranks = record["details"]["ranks"]
    assert len(ranks) == 8
    for r in ranks:
        assert r["total_bytes"] == r["exact_bytes"], r
        assert r["param_bytes"] == r["exact_param_bytes"] == r["grad_bytes"]
        assert r["optimizer_bytes"] == 2 * r["param_bytes"] + 4 * r["owned_tensors"]
    assert record["ratio"] == 1.0


@pytest.mark.slow
def test_b3_saved_bytes_follow_the_schedules(tmp_path):
    record = _bench(tmp_path, "B3")["B3"]
    _check_keys(record)
    # GPipe keeps m micro-batches per stage, 1F1B p - s: ratio 1 up to the batch-wide input/target storages
    # that all micro-batches share (counted once)
    for stage, ratio in record["details"]["ratios_per_stage"].items():
        assert 0.98 <= ratio <= 1.0, (stage, ratio)
    # full activation checkpointing: stage 0 (embedding + blocks) keeps about the blocks' inputs per micro-batch
    ac = record["details"]["activation_checkpointing"]["per_stage"]["0"]
    assert 1.0 <= ac["over_blocks_input"] <= 1.5 and ac["saved_fraction"] < 0.5, ac
    # the same with every block compiled: the checkpoint around the compiled forward keeps as little
    compiled = record["details"]["activation_checkpointing_compiled"]["per_stage"]["0"]
    assert 1.0 <= compiled["over_blocks_input"] <= 1.5 and compiled["saved_fraction"] < 0.5, compiled


@pytest.mark.slow
def test_b3_zero_bubble_holds_what_its_action_list_says_under_the_linear_split(tmp_path):
    """``B3 --schedule zbvzerobubble,interleavedzerobubble:1``: with the default linear split each stage holds what
    the action list says (ZB-V's; ZB-H1's, one stage per rank: ``pp`` on each) (the graph goes in ``I``; the linear
    layers' inputs and output gradients, counted too, until ``W``), while torch's split keeps whole graphs until they
    are dropped: more on the last stage."""
    schedules = "zbvzerobubble,interleavedzerobubble:1"
    run_lightning("bench_run.py", ["B3", "--schedule", schedules, "--tiny", "--out", tmp_path], timeout=240)
    for label, names in [("zbvzerobubble", ["0", "1", "2", "3"]), ("interleavedzerobubble-1", ["0", "1"])]:
        record = json.loads((tmp_path / f"B3_{label}.json").read_text())
        stages = record["details"]["per_stage"]
        assert sorted(stages) == names and record["details"]["rank_peak_bytes_linear"]
        for stage, row in stages.items():
            assert row["theory_deferred_weight"] >= 1, (label, stage, row)
            assert 0.95 * row["theory_in_flight"] <= row["measured_in_flight_linear"], (label, stage, row)
            assert row["measured_in_flight_linear"] <= row["theory_in_flight"] + 0.1, (label, stage, row)
        last = stages[names[-1]]
        assert last["measured_in_flight"] > last["measured_in_flight_linear"] + 1, (label, last)
        assert record["ratio"] == pytest.approx(min(r["ratio"] for r in stages.values()))
    assert [row["theory_in_flight"] for row in stages.values()] == [2, 2]  # ZB-H1 at pp2: pp on every stage


def test_every_benchmark_module_has_the_interface():
    benchmarks = _import("benchmarks")
    assert list(benchmarks.BENCHMARKS)[:9] == [f"B{i}" for i in range(9)]
    for bench_id, name in benchmarks.BENCHMARKS.items():
        module = _import(f"benchmarks.{name}")
        assert module.ID == bench_id and module.TITLE and callable(module.run) and module.__doc__


def test_record_json_and_formatting(tmp_path):
    common = _import("benchmarks.common")
    fmt = common.fmt
    record = common.Record("BX", "test", 2.0, 4.0, 1.0, 0.5, "ms", {"k": 1}, ["a line"])
    data = common.report(record, tmp_path, common.environment(), 1.0)
    on_disk = json.loads((tmp_path / "BX.json").read_text())
    assert on_disk["ratio"] == data["ratio"] == 0.5 and on_disk["details"] == {"k": 1}
    assert fmt(None) == "-" and fmt(0.12345) == "0.123" and "values" in fmt({str(i): i for i in range(9)})


def test_gpt_shard_rule():
    gpt_local_numel = _import("benchmarks.common").gpt_local_numel
    assert gpt_local_numel("body.1.attn.q_proj.bias", (256,), 2) == 128
    assert gpt_local_numel("body.1.attn.out_proj.bias", (256,), 2) == 256
    assert gpt_local_numel("body.1.ln_1.weight", (256,), 2) == 256
    assert gpt_local_numel("body.9.lm_head.weight", (2048, 256), 2) == math.prod((2048, 256)) // 2


# ---------------------------------------------------------------------- the Hugging Face Llama variants (pure logic)
def test_llama_stage_and_shard_rules():
    hf = _import("benchmarks.hf_llama")
    # 8 layers on 2 stages: embedding + layers 0..3 first, layers 4..7 + final norm + head last
    assert hf.llama_stage("model.model.embed_tokens.weight", 8, 2) == 0
    assert hf.llama_stage("model.model.layers.3.mlp.up_proj.weight", 8, 2) == 0
    assert hf.llama_stage("model.model.layers.4.self_attn.q_proj.weight", 8, 2) == 1
    assert hf.llama_stage("model.model.norm.weight", 8, 2) == 1
    assert hf.llama_stage("model.lm_head.weight", 8, 2) == 1
    with pytest.raises(ValueError):
        hf.llama_stage("model.model.rotary_emb.weight", 8, 2)
    n = hf.llama_local_numel
    assert n("model.model.layers.0.self_attn.k_proj.weight", (128, 256), 2) == 128 * 256 // 2  # GQA: narrower, split
    assert n("model.model.layers.0.self_attn.q_proj.bias", (256,), 2) == 128  # column-parallel bias split
    assert n("model.model.layers.0.self_attn.o_proj.weight", (256, 256), 2) == 256 * 128
    assert n("model.model.layers.0.mlp.down_proj.bias", (256,), 2) == 256  # row-parallel bias whole
    assert n("model.model.layers.0.input_layernorm.weight", (256,), 2) == 256
    assert n("model.model.norm.weight", (256,), 2) == 256
    assert n("model.lm_head.weight", (2048, 256), 2) == 2048 * 128
    assert n("model.lm_head.weight", (2048, 256), 1) == 2048 * 256
    params = {"model.model.embed_tokens.weight": (64, 32), "model.lm_head.weight": (64, 32)}
    assert hf.tied_local_numel(params, 2, 0, 2, tied=True) == hf.tied_local_numel(params, 2, 1, 2, tied=True) == 1024
    assert hf.tied_local_numel(params, 2, 1, 2, tied=False) == 0
    assert hf.tied_local_numel(params, 2, 1, 3, tied=True) == 0  # a middle stage holds neither


def test_llama_comm_formulas():
    f = _import("benchmarks.hf_llama").llama_comm_formulas(
        b=2, s=16, h=32, v=64, tp=2, m=4, layers=3, first=True, last=False
    )
    bsh = 2 * 16 * 32
    assert f["tp_fwd_all_reduce_calls"] == 4 * (2 * 3 + 1)  # o_proj + down_proj per layer, + the embedding
    assert f["tp_bwd_all_reduce_calls"] == 4 * 2 * 3  # q|k|v and gate|up input gradients; no head here
    assert f["tp_fwd_all_reduce_elements"] == 4 * 7 * bsh
    assert f["tp_fwd_all_gather_calls"] == f["tp_fwd_all_gather_elements"] == 0
    last = _import("benchmarks.hf_llama").llama_comm_formulas(
        b=2, s=16, h=32, v=64, tp=2, m=4, layers=3, first=False, last=True
    )
    assert last["tp_bwd_all_reduce_calls"] == 4 * 7 and last["tp_fwd_all_gather_elements"] == 4 * 2 * 16 * 32


def _llama_step_records(
    first: bool, last: bool, layers: int, m: int, bsh: int, head: int, tied: int, grads: int
) -> list[dict]:
    """What one stage's step should record under the Llama plan, written out by hand (not from the formulas)."""

    def rec(dim: str, op: str, elements: int, phase: str = "fwd", layer: str | None = None, inside: bool = True):
        return {
            "op": op,
            "dim": dim,
            "elements": elements,
            "bytes": 4 * elements,
            "layer": layer,
            "phase": phase,
            "in_schedule": inside,
        }

    out = []
    offset = 0 if first else layers
    for _ in range(m):
        if first:
            out.append(rec("tp", "all_reduce", bsh, "fwd", "embed_tokens:Embedding"))
        for i in range(layers):
            label = f"{offset + i}:LlamaDecoderLayer"
            out += [rec("tp", "all_reduce", bsh, "fwd", label), rec("tp", "all_reduce", bsh, "fwd", label)]
            out += [rec("tp", "all_reduce", bsh, "bwd", label), rec("tp", "all_reduce", bsh, "bwd", label)]
        if last:
            out.append(rec("tp", "all_gather_into_tensor", head, "fwd", "lm_head:Linear"))
            out.append(rec("tp", "all_reduce", bsh, "bwd", "lm_head:Linear"))
        out.append(rec("pp", "send", bsh))
    from lightning_3d.core.data_parallel import per_block_buckets

    if per_block_buckets("gloo"):
        per_layer = grads // (layers + 1)  # a bucket per decoder layer, the rest of the stage in one more
        out += [rec("dp", "all_reduce", per_layer) for _ in range(layers)]
        out.append(rec("dp", "all_reduce", grads - layers * per_layer))
    else:  # gloo: one bucket for the whole stage
        out.append(rec("dp", "all_reduce", grads))
    if tied:
        out.append(rec("emb", "allreduce", tied, inside=False))
    return out


def _llama_result(tied: bool) -> dict:
    b, s, h, v, m, layers = 2, 16, 32, 64, 2, 1
    config = {
        "hidden_size": h,
        "block_size": s,
        "vocab_size": v,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "tie_word_embeddings": tied,
    }
    ranks = []
    for rank, (pp, tp) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        first, last = pp == 0, pp == 1
        t = 1024 if tied else 0
        ranks.append(
            {
                "rank": rank,
                "coords": {"dp": 0, "pp": pp, "tp": tp},
                "first": first,
                "last": last,
                "layers": layers,
                "grad_elements_exact": 5000 + pp,
                "tied_elements_exact": t,
                "records": _llama_step_records(first, last, layers, m, b * s * h, b * s * v // 2, t, 5000 + pp),
            }
        )
    return {"ranks": ranks, "config": config}


def test_llama_comm_analysis_on_a_hand_made_record():
    b5 = _import("benchmarks.b5_comm")
    for tied in (False, True):
        result = b5.analyse_llama(_llama_result(tied), m=2, batch=4)
        assert result["unexplained_in_schedule"] == []
        bad = {k: c for k, c in result["checks"].items() if c["ratio"] != 1.0}
        assert bad == {}, bad
        assert result["checks"]["tied-weight all-reduces per step (embedding group)"]["measured"] == int(tied)
        assert result["checks"]["TP all-reduces per layer per micro-batch (bwd)"]["measured"] == 2


def test_llama_comm_analysis_reports_extra_and_missing_collectives():
    b5 = _import("benchmarks.b5_comm")
    res = _llama_result(tied=True)
    recs = res["ranks"][2]["records"]  # a last-stage rank
    # a third backward all-reduce in a layer (q, k and v converting their input separately would do this)
    recs.append({**next(r for r in recs if r["phase"] == "bwd" and r["layer"] == "1:LlamaDecoderLayer")})
    recs.append({**recs[0], "layer": None})  # a TP collective outside any module
    res["ranks"][0]["records"] = [r for r in res["ranks"][0]["records"] if r["dim"] != "emb"]  # tied sum missing
    result = b5.analyse_llama(res, m=2, batch=4)
    checks = result["checks"]
    assert checks["TP all-reduces per layer per micro-batch (bwd)"]["measured"] == 2.5
    assert checks["TP all-reduces per step, last stage (bwd)"]["ratio"] == pytest.approx(7 / 6)
    assert checks["tied-weight all-reduces per step (embedding group)"]["measured"] == 0
    assert len(result["unexplained_in_schedule"]) == 1


def test_cli_model_option_is_refused_where_there_is_no_variant():
    main = _import("benchmarks.__main__").main
    for argv in (
        ["B1", "--model", "hf_llama"],
        ["B2", "--model", "hf_llama_tied"],
        ["B4", "--model", "nope"],
        ["B4", "--model", "xl-shallow"],  # FSDP's memory record: with --data-parallel fsdp only
        ["B1", "--data-parallel", "fsdp", "--model", "xl-shallow"],
    ):
        with pytest.raises(SystemExit):
            main([*argv, "--out", "/nonexistent"])
    assert _import("benchmarks.b4_state").MODELS == ("gpt", "hf_llama", "hf_llama_tied")


def _dp_rank(ops: list[tuple[str, int, int]], elements: int) -> dict:
    """One rank's B5 result with the given data-parallel (op, elements, bytes) records, 2 layers held."""
    records = [{"op": op, "dim": "dp", "elements": n, "bytes": b, "in_schedule": True} for op, n, b in ops]
    return {"records": records, "grad_elements_exact": elements, "layers": ["0", "1"], "fsdp_unpadded": True}


def test_b5_grad_reduce_counts_bytes_against_the_formula():
    """B5 --grad-reduce-dtype's check: bf16 bytes are 2 per gradient element, half the fp32 default's; fp32 bytes on
    the wire (no compression) are seen as twice the formula."""
    b5 = _import("benchmarks.b5_comm")

    def checks(mode: str, ops: list[tuple[str, int, int]]) -> dict:
        found: dict = {}
        b5._check_grad_reduction([_dp_rank(ops, 100)], lambda n, m, f, note="": found.update({n: (m, f)}), mode, "bf16")
        return found

    ok = checks("replicate", [("allreduce", 60, 120), ("allreduce", 40, 80)])
    assert ok["DDP all-reduce bytes per step (bf16)"] == (200, 200)
    assert ok["DDP all-reduce bytes / the default's fp32 bytes"] == (0.5, 0.5)
    fp32 = checks("replicate", [("allreduce", 60, 240), ("allreduce", 40, 160)])
    assert fp32["DDP all-reduce bytes per step (bf16)"] == (400, 200)
    gathers = [("_allgather_base", 30, 120), ("_allgather_base", 20, 80)]
    fsdp = checks("fsdp", [("_reduce_scatter_base", 60, 120), ("_reduce_scatter_base", 40, 80), *gathers])
    assert fsdp["FSDP reduce-scatter calls per step"] == (2, 2)
    assert fsdp["FSDP reduce-scatter bytes per step (bf16)"] == (200, 200)
    assert fsdp["FSDP all-gather bytes per step (fp32 parameters)"] == (200, 200)
    assert fsdp["other data-parallel collectives per step"] == (0, 0)
    main = _import("benchmarks.__main__").main
    for argv in (["B4", "--grad-reduce-dtype", "bf16"], ["B5", "--grad-reduce-dtype", "fp8"]):
        with pytest.raises(SystemExit):
            main([*argv, "--out", "/nonexistent"])


@pytest.mark.slow
def test_b8_no_host_synchronisation_per_micro_batch():
    """B8's counter over a real fit: one rank with two interleaved stages (m=4) adds at most one host
    synchronisation per step over plain Lightning, none inside micro-batches (each run in a fresh process)."""
    common = _import("benchmarks.common")
    b8 = _import("benchmarks.b8_sync")
    baseline = common.launch("b8_sync:worker", 1, {"layout": None, "tiny": True}, timeout=240)
    name = "one_rank_two_stages_interleaved_m4"
    layout = common.launch("b8_sync:worker", 1, {"layout": name, "tiny": True}, timeout=240)
    measured, per_micro, _ = b8.added({name: layout}, baseline)
    assert layout["in_micro_batches_per_step"] == 0 and per_micro == 0, layout["sources"]
    assert measured <= 1, layout["sources"]
    assert layout["optimizer_per_step"] == baseline["optimizer_per_step"] > 0  # the same optimizer on both sides


def test_b1_imbalance_over_steps_keeps_a_slower_rank_and_drops_one_steps_noise():
    """B1's ``details.imbalance``: each rank's median compute over the recorded steps, slowest over mean."""
    b1 = _import("benchmarks.b1_pipeline")

    def step(c0: float, c1: float) -> dict:
        return {"ranks": {"0": {"compute_ms": c0}, "1": {"compute_ms": c1}}}

    # equal ranks, one of them disturbed in each step: every single step reads 1.1, the medians are equal
    flips = [step(110, 90), step(90, 110), step(100, 100), step(110, 90), step(90, 110)]
    over = b1.imbalance_over_steps({"n_micro": 10, "ranks": flips[2]["ranks"], "recorded_steps": flips})
    assert over["imbalance"] == pytest.approx(1.0) and over["steps"] == 5
    assert over["compute_per_microbatch_ms"] == pytest.approx([10.0, 10.0])
    assert max(over["per_step"]) == pytest.approx(1.1) and min(over["per_step"]) == pytest.approx(1.0)
    # rank 1 slower in every step (a heavier stage): kept
    slower = [step(100, 120), step(104, 126), step(98, 118)]
    over = b1.imbalance_over_steps({"n_micro": 2, "ranks": slower[0]["ranks"], "recorded_steps": slower})
    assert over["imbalance"] == pytest.approx(120 / 110)
    # a summary without recorded steps is its own single step
    alone = b1.imbalance_over_steps({"n_micro": 1, **step(100, 300)})
    assert alone["imbalance"] == pytest.approx(1.5) and alone["per_step"] == pytest.approx([1.5])


@pytest.mark.slow
def test_b1_schedule_and_partitioner_options_reach_the_record(tmp_path):
    main = _import("benchmarks.__main__").main
    with pytest.raises(SystemExit):  # the options are B1's alone
        main(["B2", "--schedule", "gpipe", "--out", str(tmp_path)])
    run_lightning(
        "bench_run.py",
        ["B1", "--tiny", "--schedule", "zbvzerobubble", "--partitioner", "compute", "--out", tmp_path],
        timeout=240,
    )
    record = json.loads((tmp_path / "B1.json").read_text())
    _check_keys(record)
    details = record["details"]
    assert (details["schedule"], details["partitioner"], details["stages_per_rank"]) == ("zbvzerobubble", "compute", 2)
    assert "zbvzerobubble" in record["unit"] and "compute" in record["unit"]
    assert record["ratio"] == pytest.approx(details["table"]["4"]["zbvzerobubble"]["ratio"])
    assert set(details["timeline"]) == {"1f1b", "zbvzerobubble"}  # timed beside 1F1B in the same run
    assert details["imbalance"] >= 1.0 and details["imbalance_median_step"] >= 1.0
    steps = details["bounds"]["zbvzerobubble"]["over_steps"]  # one recorded step with --tiny: the two agree
    assert steps["steps"] == 1 and details["imbalance"] == pytest.approx(details["imbalance_median_step"])
    contention = details["host_contention"]  # both ranks ran the whole model at once: one time per rank
    assert len(contention["both_ranks_ms"]) == 2 and all(t > 0 for t in contention["both_ranks_ms"])
    assert contention["alone_ms"] == pytest.approx(details["table"]["4"]["baseline_ms"])
    # the worker checked that both ranks took the same split from the gathered table of measured times
    split = details["split"]["zbvzerobubble"]
    assert len(split["layers"]) == 4 and all(e.endswith("measured") for e in split["estimates"])
    zbv = details["timeline"]["zbvzerobubble"]
    assert zbv["theory_source"] == "action list" and details["timeline"]["1f1b"]["theory_source"] == "formula"
    assert zbv["stages_per_rank"] == 2 and all(0.0 <= r["theory"] < 1.0 for r in zbv["ranks"].values())


def test_peak_tracker_follows_live_tensor_bytes():
    """benchmarks/mem_tracker.py: the peak is the most bytes alive at once, freed tensors stop counting."""
    torch = _import("torch")
    tracker = _import("benchmarks.mem_tracker").peak_tracker()
    with tracker:
        a = torch.zeros(1000, 1000)  # 4 MB
        b = torch.zeros(1000, 1000)
        del a, b
        c = torch.zeros(500, 1000)
        assert tracker.live() == 2_000_000 and tracker.peak == 8_000_000
        tracker.reset_peak()
        c.untyped_storage().resize_(0)  # how FSDP2 frees its gathered parameters
        d = torch.ones(10)  # noqa: F841 (alive while counted)
        assert tracker.live() == 40 and tracker.peak == 2_000_000
    # on_peak: called with the live storages (bytes, data pointer), largest first, at each new peak
    tracker = _import("benchmarks.mem_tracker").peak_tracker()
    tracker.on_peak = lambda op, storages: (op, [n for n, _ in storages])
    with tracker:
        e = torch.zeros(100)
        f = torch.zeros(1000)  # noqa: F841
        del e
        g = torch.zeros(10)  # noqa: F841 (below the peak: no call)
    assert tracker.at_peak[1] == [4000, 400] and tracker.peak == 4400
    b4 = _import("benchmarks.b4_state")
    line = b4.describe_peak({"op": "mm", "bytes": {"other": 2**20, "gathered params": 3 * 2**20}, "live": 4 * 2**20,
                             "other_largest": [2**20]}, 2**20)  # fmt: skip
    assert line.startswith("at mm: live 4.0 MB = gathered params 3.0, other 1.0 MB (share 1.0 MB)"), line


@pytest.mark.slow
def test_b4_fsdp_builds_each_rank_as_shards_plus_one_layer(tmp_path):
    """Under FSDP at tp2 x pp2 x dp2, a model built on the meta device is materialised as shards: building the
    stages never holds more live tensor bytes than the rank's parameter share plus one block's full weights (the
    whole stage would be twice that), the initial parameters are exactly one process's, and one all-gather and
    one reduce-scatter per FSDP unit (two blocks and the stage root) run per step under the pipeline."""
    args = ["B4", "--data-parallel", "fsdp", "--model", "xl-shallow", "--tiny", "--out", tmp_path]
    run_lightning("bench_run.py", args, timeout=420)
    record = json.loads((tmp_path / "B4_fsdp_xl-shallow.json").read_text())
    _check_keys(record)
    run = record["details"]["runs"]["False"]
    assert run["init_max_abs_diff"] == [0.0]
    for r in run["ranks"]:
        assert r["live_before_build"] <= 4096, r  # nothing of the model before the build (mesh tables)
        assert r["build_peak"] <= r["exact_param_bytes"] + r["block_full_bytes"] + 4096, r  # + mesh rank tables
        assert r["setup_ok"], r
        assert r["all_gathers_per_step"] == [3] * len(r["all_gathers_per_step"]), r
        assert all(s["reduce_scatters"] == 3 for s in r["steps"]), r


def test_b3_in_flight_theory_counts_micro_batches_until_their_backward_is_complete():
    from lightning_3d.core import torch_compat

    b3 = _import("benchmarks.b3_activations")
    one_f_one_b = torch_compat.parse_schedule_actions([["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"]])[0]
    assert b3.in_flight_theory(one_f_one_b, 0) == {"in_flight": 2, "deferred": 0}
    # input-gradients run, weight-gradients deferred: the activations stay until W
    row = ["0F0", "0F1", "0I0", "1F0", "0I1", "0W0", "0F2", "0I2", "0W1", "0W2"]
    split = torch_compat.parse_schedule_actions([row])
    assert b3.in_flight_theory(split[0], 0) == {"in_flight": 2, "deferred": 2}
    assert b3.in_flight_theory(split[0], 1) == {"in_flight": 1, "deferred": 0}


def test_b3_tracker_counts_held_tensors_by_storage_while_they_live():
    """What the linear split holds from ``I`` to ``W`` (``tracker.hold``) is counted with autograd's saved tensors:
    once per storage, charged to the stage whose backward runs, released when the held tensor object goes."""
    import torch

    b3 = _import("benchmarks.b3_activations")
    tracker = b3.SavedTensorTracker(exclude=set())
    a = torch.ones(4, 8)  # 128 bytes
    with torch.autograd.graph.saved_tensors_hooks(tracker._pack, tracker._unpack):
        tracker.current = 1
        b = a.requires_grad_() * 2
        y = b.sin()  # saves its input ``b``: 128 bytes, stage 1
    assert tracker.rank_live == 128 and tracker.live[1] == 128
    tracker.backward_stage = 3
    held = b.detach()  # the saved tensor's storage again: counted once
    tracker.hold(held)
    tracker.hold(torch.zeros(2, 8))  # a temporary: released at once
    assert tracker.rank_live == 128 and tracker.peak[3] == 64 and tracker.live[3] == 0
    kept = torch.zeros(16)
    tracker.hold(kept)
    del y, b  # the graph goes; the held view of its saved storage keeps the bytes counted
    assert tracker.rank_live == 128 + 64 and tracker.holds(held.untyped_storage().data_ptr())
    del held, kept
    assert tracker.rank_live == 0 and tracker.rank_peak == 192


def test_b1_host_contention_factor_and_corrected_ratio():
    b1 = _import("benchmarks.b1_pipeline")
    # two rounds, two ranks: medians 1.2 s and 1.0 s (rank 0 and 1) -> mean 1.1 s over 1.0 s alone
    got = b1.host_contention([[1.1, 0.9], [1.3, 1.1]], 1000.0, speedup=1.5, m=8)
    assert got["both_ranks_ms"] == pytest.approx([1200.0, 1000.0])
    assert got["factor"] == pytest.approx(1.1)
    assert got["ratio_against_contended_baseline"] == pytest.approx(1.5 * 1.1 / (16 / 9))


def test_b1_sweep_table_and_goals():
    b1 = _import("benchmarks.b1_pipeline")
    cell = {"ratio": 0.9, "speedup": 1.5, "bubble_measured": 0.3, "bubble_theory": 0.2, "compute_over_baseline": 1.1}
    results = {"pp2": {"cells": {"1f1b/4": cell, "csv/4": {**cell, "speedup": 1.6}, "zbvzerobubble/4": cell}}}
    lines = b1.sweep_table(results, ["1f1b", "csv", "dualpipev"], [4, 8])
    assert lines[2] == "| pp2 | 1f1b | 0.90 (x1.50), 30%/20%, 1.10 | not runnable |"
    assert lines[4].endswith("| not runnable | not runnable |")
    goals = {g["schedule"]: g["met"] for g in b1.zero_bubble_goals(results, [4, 8])}
    assert goals == {"csv": True, "zbvzerobubble": True}  # no rounds: at or above 1F1B's speed-up at the same m
    # with rounds, judged round by round: a slow round 2 for 1F1B alone puts zbv's median (98 ms) under 1F1B's
    # (100 ms) while zbv is slower in 2 of 3 paired rounds; csv's median (150 ms) is over 1F1B's while it is faster in
    # 2 of 3
    cells = results["pp2"]["cells"]
    cells["1f1b/4"]["rounds_ms"] = [100.0, 300.0, 90.0]
    cells["zbvzerobubble/4"] = {**cell, "rounds_ms": [105.0, 98.0, 95.0]}
    cells["csv/4"]["rounds_ms"] = [99.0, 290.0, 150.0]
    got = {g["schedule"]: g for g in b1.zero_bubble_goals(results, [4])}
    assert not got["zbvzerobubble"]["met"] and got["zbvzerobubble"]["over_1f1b"] == pytest.approx(100 / 105)
    assert got["csv"]["met"] and got["csv"]["over_1f1b"] == pytest.approx(100 / 99)
    assert got["csv"]["over_1f1b_range"] == pytest.approx([90 / 150, 300 / 290])


def test_b1_takes_a_csv_action_list_as_its_schedule(tmp_path):
    """``B1 --schedule path.csv``: the file's stages per rank (1 for a 1F1B-like list, not the 2 of torch's
    multi-stage schedules, whose runtime reads CSVs), its path kept as written, its stem in file names."""
    b1 = _import("benchmarks.b1_pipeline")
    one = tmp_path / "My1F1B_pp2.csv"
    one.write_text("0F0,0F1,0B0,0B1\n,1F0,1B0,1F1,1B1\n")
    two = tmp_path / "zbv.csv"
    _import("lightning_3d.core.pipeline").write_csv_schedule("zbvzerobubble", 2, 2, 4, two)
    assert b1.stages_per_rank_of(str(one)) == 1 and b1.stages_per_rank_of(str(two)) == 2
    assert b1.stages_per_rank_of("1f1b") == 1 and b1.stages_per_rank_of("interleaved1f1b") == 2
    assert b1.compared_schedules(str(one)) == ("1f1b", str(one))  # the path's capitals kept
    assert b1.compared_schedules("GPipe") == ("1f1b", "gpipe")
    assert b1.schedule_label(str(one)) == "My1F1B_pp2" and b1.schedule_label("1f1b") == "1f1b"
    assert b1.runnable_ms(str(one), [1, 2, 4, 8]) == [2]  # the file's own micro-batch count


def test_b1_takes_a_schedule_with_its_stage_count():
    """``NAME:STAGES_PER_RANK`` (``interleavedzerobubble:1``, ZB-H1): the count given wins over the schedule's
    default, the name alone builds and checks the schedule, file names get a dash; a count the strategy refuses
    is refused before any process starts."""
    b1, common = _import("benchmarks.b1_pipeline"), _import("benchmarks.common")
    assert common.schedule_spec("interleavedzerobubble:1") == ("interleavedzerobubble", 1)
    assert common.schedule_spec("zbvzerobubble") == ("zbvzerobubble", None)
    assert common.schedule_spec("/tmp/a:b/list.csv") == ("/tmp/a:b/list.csv", None)
    assert b1.stages_per_rank_of("interleavedzerobubble:1") == 1 and b1.stages_per_rank_of("interleavedzerobubble") == 2
    assert b1.schedule_label("interleavedzerobubble:1") == "interleavedzerobubble-1"
    assert b1.runnable_ms("interleavedzerobubble:1", [1, 2, 5, 8]) == [2, 8]  # >= pp, whole rounds
    assert b1.compared_schedules("InterleavedZeroBubble:1") == ("1f1b", "interleavedzerobubble:1")
    with pytest.raises(ValueError, match="needs stages_per_rank >= 2"):
        b1.run(Path("unused"), schedule="interleaved1f1b:1")


def test_sweep_and_b3_schedule_options_are_refused_elsewhere(tmp_path):
    main = _import("benchmarks.__main__").main
    for argv in (["B2", "--sweep"], ["B1", "B3", "--sweep"], ["B2", "--schedule", "1f1b"]):
        with pytest.raises(SystemExit):
            main([*argv, "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())  # refused before anything ran


def test_s1_split_backward_times_every_variant_per_stage(tmp_path):
    """S1's plumbing in this process (tiny blocks, nothing timed): F, B, I and W are timed for every stage size,
    torch's weight-gradient pass makes one call per parameter group, the same number for each block, the linear split
    (the strategy's default) is timed beside it, and the record keeps its I + W against the whole backward."""
    s1 = _import("benchmarks.s1_split_backward")
    record = s1.run(tmp_path, tiny=True)
    rows = record.details["blocks"]
    assert list(rows) == ["1", "2"]
    for row in rows.values():
        keys = ("forward", "whole", "split", "I", "W", "linear F", "linear", "linear I", "linear W")
        assert all(row[key] > 0 for key in keys)
        assert row["split"] >= row["I"] and row["split"] >= row["W"] and row["linear"] >= row["linear W"]
        assert row["overhead_share"] == (row["split"] - row["whole"]) / (row["forward"] + row["whole"])
        excess = row["linear F"] + row["linear"] - row["forward"] - row["whole"]
        assert row["linear_overhead_share"] == excess / (row["forward"] + row["whole"])
        held = row["held_for_W_MB"]  # torch keeps (nearly) the whole graph for W; the linear split a part of it
        assert 0 < held["linear"] < held["torch"] <= held["saved"] + 1e-9
    assert rows["1"]["param_groups"] > 0 and rows["2"]["param_groups"] == 2 * rows["1"]["param_groups"]
    assert record.baseline == round(rows["2"]["whole"], 3) and record.ratio == round(
        rows["2"]["linear"] / rows["2"]["whole"], 3
    )
