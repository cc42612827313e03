"""The compute and memory partitioners: the split over contiguous stages and the per-layer profiles."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_3d.core import balance, partition, pipeline, torch_compat


def _split(costs: list[float], stages: int) -> list[range]:
    return balance.balanced_split(len(costs), stages, lambda s, i, j: sum(costs[i:j]))


def test_split_isolates_one_heavy_layer():
    assert _split([1, 1, 10, 1, 1, 1], 3) == [range(0, 2), range(2, 3), range(3, 6)]
    assert _split([10, 1, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 6)]
    assert _split([1, 1, 1, 1, 1, 10], 2) == [range(0, 5), range(5, 6)]


def test_split_is_optimal_against_brute_force():
    import itertools

    costs = [3, 1, 4, 1, 5, 9, 2, 6]
    best = min(
        max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, len(costs))))
        for cuts in itertools.combinations(range(1, len(costs)), 3)
    )
    got = _split(costs, 4)
    assert [i for r in got for i in r] == list(range(len(costs))) and all(len(r) for r in got)
    assert max(sum(costs[r.start : r.stop]) for r in got) == best


def test_split_can_depend_on_the_stage():
    # stage 0 pays double (as under 1F1B, where the first stage keeps the most micro-batches in flight)
    got = balance.balanced_split(4, 2, lambda s, i, j: (2 if s == 0 else 1) * (j - i))
    assert got == [range(0, 1), range(1, 4)]


def test_compute_partitioner_gives_the_heavy_layer_a_stage_of_its_own():
    body = [
        ("0", nn.Linear(16, 16)),
        ("1", nn.Linear(16, 16)),
        ("2", nn.Linear(16, 512)),  # heavy: 32 times the others' products, and the next one's too
        ("3", nn.Linear(512, 16)),
        ("4", nn.Linear(16, 16)),
        ("5", nn.Linear(16, 16)),
    ]
    ranges = balance.ComputePartitioner(torch.zeros(8, 16), measure=False)(body, 4)  # FLOPs counted
    assert ranges == [range(0, 2), range(2, 3), range(3, 4), range(4, 6)]


def _heavy_body() -> list[tuple[str, nn.Module]]:
    """Six layers; layer 2 does about 60 times the work of each other layer (two 64 x 2048 products)."""
    body = [(str(i), nn.Linear(64, 64)) for i in range(6)]
    body[2] = ("2", nn.Sequential(nn.Linear(64, 2048), nn.GELU(), nn.Linear(2048, 64)))
    return body


def test_measured_compute_partitioner_isolates_the_heavy_layer_and_keeps_the_rng():
    body = _heavy_body()
    before = [p.detach().clone() for _, m in body for p in m.parameters()]
    part = balance.ComputePartitioner(torch.randn(128, 64))
    rng = torch.get_rng_state()
    ranges = part(body, 3)
    assert part.measured and part.fallback is None
    assert ranges == [range(0, 2), range(2, 3), range(3, 6)]  # the heavy layer alone on a stage
    assert torch.equal(rng, torch.get_rng_state())  # timing drew no number from the run's generator
    assert all(torch.equal(a, p) for a, p in zip(before, (p for _, m in body for p in m.parameters())))
    assert all(p.grad is None for _, m in body for p in m.parameters())  # timed on copies
    estimates = [part.describe(c) for c in part.stage_costs(body, ranges)]
    assert all(e.endswith("ms fwd+bwd per micro-batch, measured") for e in estimates)


def test_measured_times_of_layers_alike_are_shared_and_meta_layers_are_timed_on_copies():
    with torch.device("meta"):
        body = [(str(i), nn.Linear(32, 32)) for i in range(4)] + [("head", nn.Linear(32, 100))]
    rng = torch.get_rng_state()
    times = balance.measure_layer_times(body, torch.zeros(4, 32, device="meta"), runs=3)
    assert torch.equal(rng, torch.get_rng_state())  # materialising the copies (reset_parameters) forked the RNG
    assert len(set(times[:4])) == 1 and times[4] > 0  # one median for the four equal layers
    assert all(p.is_meta for _, m in body for p in m.parameters())  # the model itself stays on meta
    x = torch.zeros(4, 32)
    window = [nn.Sequential(nn.Linear(32, 32), nn.Dropout(p)) for p in (0.1, 0.1, 0.2)]
    sig = [balance._signature(m, x, False) for m in window]
    assert sig[0] == sig[1] != sig[2]  # equal shapes, another setting: timed on its own
    assert balance._signature(window[0], x, True) != sig[0]  # the last layer is timed with the loss


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x), x


def test_compute_partitioner_falls_back_to_flops_when_a_layer_cannot_be_timed():
    body = [("0", nn.Linear(8, 8)), ("1", _Pair()), ("2", nn.Linear(8, 8))]
    part = balance.ComputePartitioner(torch.zeros(2, 8))
    with pytest.warns(UserWarning, match="FLOPs"):
        with pytest.raises(Exception):  # noqa: B017 - the FLOP profile cannot pass a tuple on either
            part(body, 2)
    assert not part.measured and "not one tensor" in part.fallback


def test_profiles_count_flops_and_bytes_on_meta():
    flops, static, act, held, selective = balance.layer_profiles([("0", nn.Linear(8, 16))], torch.zeros(4, 8))[0]
    assert flops == 3 * 2 * 4 * 8 * 16  # forward, input gradient, weight gradient
    assert static == (8 * 16 + 16) * 4 * (2 + balance.OPTIMIZER_STATES)
    assert act == 4 * 8 * 4  # the input, saved for the weight gradient (the weight itself is static)
    assert held == 4 * 8 * 4  # checkpointed: the input alone
    assert selective == held + 4 * 16 * 4  # selective: and the matmul's output


def test_memory_estimate_matches_measured_bytes():
    """Static bytes against a real Adam step, activation bytes against the tensors autograd really saves."""
    layer = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    x = torch.randn(16, 32, requires_grad=True)  # a later stage's input (needs its gradient)
    _, static, act = balance.layer_profiles([("0", layer)], x)[0][:3]
    saved: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:  # memory the step holds for this micro-batch
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
    out.sum().backward()
    opt = torch.optim.Adam(layer.parameters())
    opt.step()
    measured_static = sum(p.numel() * p.element_size() for p in layer.parameters()) * 2 + sum(
        v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if v.dim() > 0
    )
    assert abs(static - measured_static) <= 0.1 * measured_static
    assert abs(act - sum(saved.values())) <= 0.1 * sum(saved.values())


def test_memory_estimate_per_stage_matches_measured_bytes_with_1f1b_micro_batches_in_flight():
    """Each stage's estimate (static bytes + p - s micro-batches of saved activations) against a real Adam step and
    the storages autograd really holds while that many micro-batches wait for their backward."""
    torch.manual_seed(0)
    body = [(str(i), nn.Sequential(nn.Linear(32, 96), nn.GELU(), nn.Linear(96, 32))) for i in range(4)]
    example = torch.randn(256, 32)  # activations outweigh the static bytes: a wrong in-flight count fails
    part = partition.get_partitioner("memory").for_input(example)
    ranges = [range(0, 2), range(2, 4)]
    estimates = part.stage_costs(body, ranges)
    for s, r in enumerate(ranges):
        stage = nn.Sequential(*(body[i][1] for i in r))
        weights = {p.untyped_storage().data_ptr() for p in stage.parameters()}
        saved: dict[int, int] = {}

        def pack(t, saved=saved, weights=weights):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in weights:
                saved[ptr] = t.untyped_storage().nbytes()
            return t

        outs = []
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for _ in range(len(ranges) - s):  # 1F1B: stage s holds p - s micro-batches before its first backward
                x = torch.randn(256, 32, requires_grad=s > 0)
                outs.append(stage(x))
        activations = sum(saved.values())
        sum(o.sum() for o in outs).backward()
        opt = torch.optim.Adam(stage.parameters())
        opt.step()
        static = sum(p.numel() * p.element_size() for p in stage.parameters()) * 2 + sum(
            v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if v.dim() > 0
        )
        measured = static + activations
        assert abs(estimates[s] - measured) <= 0.1 * measured, (s, estimates[s], measured)


def _static_bytes(stage: nn.Module) -> int:
    """Parameters, their gradients and Adam's states after one real step."""
    opt = torch.optim.Adam(stage.parameters())
    opt.step()
    return sum(p.numel() * p.element_size() for p in stage.parameters()) * 2 + sum(
        v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if v.dim() > 0
    )


@pytest.mark.parametrize("schedule", ["interleavedzerobubble", "zbvzerobubble", "dualpipev", "interleaved1f1b"])
def test_memory_estimate_per_stage_matches_bytes_held_while_the_schedule_runs(schedule):
    """Each stage's estimate (static bytes + the micro-batches the schedule holds there, counted on its action list)
    against the activation bytes autograd really holds while each rank replays its action list: forwards, full
    backwards, and torch's own input- and weight-gradient halves (``I`` keeps the graph until ``W``)."""
    import weakref

    torch.manual_seed(0)
    pp, m, n = 2, 4, 256
    body = [(str(i), nn.Sequential(nn.Linear(32, 96), nn.GELU(), nn.Linear(96, 32))) for i in range(2 * pp)]
    held = pipeline.activations_in_flight(schedule, pp, 2, m)
    part = partition.get_partitioner("memory").for_input(torch.randn(n, 32)).for_schedule(held, schedule)
    estimates = part.stage_costs(body, [range(i, i + 1) for i in range(2 * pp)])
    assert "under " + schedule in part.describe(estimates[0], 0)
    order = pipeline.schedule_actions(schedule, pp, 2, m)
    backward_input, backward_weight = torch_compat.split_backward_functions()
    peak = [0] * (2 * pp)
    for rank in range(pp):
        saved: list[tuple[weakref.ref, int, int, int]] = []  # (tensor, storage, bytes, stage), while alive
        live: dict[tuple[int, int], list] = {}

        def live_bytes(stage: int, saved: list = saved) -> int:
            alive = {ptr: size for ref, ptr, size, s in saved if s == stage and ref() is not None}
            return sum(alive.values())

        actions = [a for action in order[rank] for a in (getattr(action, "sub_actions", None) or [action])]
        for action in actions:
            if action is None:
                continue
            s, k, kind = action.stage_index, action.microbatch_index, str(action.computation_type.value)
            layer = body[s][1]
            weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
            if kind == "F":
                x = torch.randn(n, 32, requires_grad=True)

                def pack(t, s=s, weights=weights, saved=saved):
                    ptr = t.untyped_storage().data_ptr()
                    if ptr not in weights:
                        saved.append((weakref.ref(t), ptr, t.untyped_storage().nbytes(), s))
                    return t

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    live[s, k] = [x, layer(x).sum(), None]
            elif kind == "B":
                live.pop((s, k))[1].backward()
            elif kind == "I":
                x, loss, _ = live[s, k]
                live[s, k] = [x, None, backward_input([loss], None, [x], layer.parameters())[1]]
            elif kind == "W":
                backward_weight(layer.parameters(), live.pop((s, k))[2])
            peak[s] = max(peak[s], live_bytes(s))
        assert not live, f"rank {rank}: micro-batches never finished their backward: {sorted(live)}"
    for s in range(2 * pp):
        measured = _static_bytes(body[s][1]) + peak[s]
        assert abs(estimates[s] - measured) <= 0.1 * measured, (schedule, s, held, estimates[s], measured)


def test_in_flight_counts_follow_each_schedule():
    # single-stage schedules: 1F1B holds p - s (at most m), GPipe every micro-batch
    assert pipeline.activations_in_flight("1f1b", 4, 1, 8) == [4, 3, 2, 1]
    assert pipeline.activations_in_flight("1f1b", 4, 1, 2) == [2, 2, 2, 1]
    assert pipeline.activations_in_flight("gpipe", 2, 1, 8) == [8, 8]
    assert pipeline.activations_in_flight("loopedbfs", 2, 2, 8) == [8] * 4  # every forward before any backward
    # a CSV action list is counted on its own rows: the greedy zero-bubble list keeps 2 pp - rank micro-batches
    # until their weight gradient (see csv_schedule.zero_bubble_greedy_rows), twice 1F1B's count on rank 0
    import csv as csv_module
    import tempfile
    from pathlib import Path

    from lightning_3d.core import csv_schedule

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "zb.csv"
        with open(path, "w", newline="") as handle:
            csv_module.writer(handle).writerows(csv_schedule.zero_bubble_greedy_rows(2, 8))
        assert pipeline.activations_in_flight(str(path), 2, 1, 8) == [4, 3]
        # a named schedule written out as a CSV file counts the same as the schedule itself
        written = pipeline.write_csv_schedule("interleavedzerobubble", 2, 2, 8, Path(folder) / "izb.csv")
        assert pipeline.activations_in_flight(str(written), 2, 2, 8) == pipeline.activations_in_flight(
            "interleavedzerobubble", 2, 2, 8
        )


def test_memory_partitioner_without_a_schedule_assumes_1f1b_and_refuses_a_wrong_count():
    part = partition.get_partitioner("memory").for_input(torch.zeros(2, 8))
    layers = [(str(i), nn.Linear(8, 8)) for i in range(3)]
    assert part.held(3, 0) == 3 and "1F1B" in part.describe(1.0, 0)
    with pytest.raises(ValueError, match="in-flight counts for 2 stages"):
        part.for_schedule([2, 1], "1f1b")(layers, 3)


def test_compute_partitioner_without_example_says_what_to_do():
    with pytest.raises(ValueError, match="example_input_array"):
        balance.ComputePartitioner()([("0", nn.Linear(2, 2)), ("1", nn.Linear(2, 2))], 2)


def test_layout_print_out_shows_each_stages_estimate():
    body = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    ref = partition.BodyRef(parent=nn.Module(), attr="body", fqn="body", module=body)
    plan = partition.plan_stages(ref, 2, partition.get_partitioner("memory").for_input(torch.zeros(2, 8)))
    text = plan.describe()
    assert text.count("MiB peak") == 2 and "stage 1 on pp rank 1" in text
    for line in text.splitlines():  # one level of parentheses: the estimate's own details are not nested
        depth = 0
        for char in line:
            depth += {"(": 1, ")": -1}.get(char, 0)
            assert depth <= 1, line
    assert len(plan.costs) == 2 and plan.predicted_imbalance() == max(plan.costs) / (sum(plan.costs) / 2)
    assert partition.StagePlan([["0"], ["1"]], costs=[1.0, 3.0], stage_to_rank=[0, 0]).predicted_imbalance() == 1.0
    assert partition.get_partitioner("compute").kind == "compute"


class _BlockModel(nn.Module):
    """Embedding, a ModuleList of blocks (block 2 ``wide / 16`` times wider) and a head: a model split at its
    blocks."""

    def __init__(self, wide: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, wide if i == 2 else 16), nn.Linear(wide if i == 2 else 16, 16))
            for i in range(5)
        )
        self.head = nn.Linear(16, 50)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_block_profiles_count_embeddings_and_head_on_the_end_blocks():
    model = _BlockModel()
    example = torch.zeros(2, 8, dtype=torch.long)
    prof = balance.block_profiles(model, list(model.blocks), example)
    tokens = 2 * 8
    mm = [2 * tokens * 16 * 16 * 2] * 5  # forward FLOPs of two 16x16 linears per block
    mm[2] = 2 * tokens * 16 * 128 * 2
    mm[4] += 2 * tokens * 16 * 50  # the head on the last block
    assert [p[0] for p in prof] == pytest.approx([3 * f for f in mm])
    per_param = 4 * (2 + balance.OPTIMIZER_STATES)  # float32: weights, grads, two Adam states
    static = [sum(p.numel() for p in b.parameters()) * per_param for b in model.blocks]
    static[0] += model.embed.weight.numel() * per_param
    static[4] += sum(p.numel() for p in model.head.parameters()) * per_param
    assert [p[1] for p in prof] == pytest.approx(static)
    assert all(p[2] > 0 for p in prof) and prof[2][2] > prof[1][2]  # the wide block saves its wide activation
    assert [p[3] for p in prof] == [tokens * 16 * 4] * 5  # each block's input: the hidden states
    outputs = [tokens * (16 + 16) * 4] * 5  # selective also keeps each matmul's output
    outputs[2] = tokens * (128 + 16) * 4
    assert [p[4] - p[3] for p in prof] == outputs
    assert next(model.parameters()).device.type == "cpu"  # the model itself is untouched

    part = balance.ComputePartitioner(measure=False).for_blocks(model, list(model.blocks), example)
    ranges = part(list(model.blocks.named_children()), 3)
    assert [list(r) for r in ranges] == [[0, 1], [2], [3, 4]]  # the heavy block alone
    with pytest.raises(ValueError, match="example_input_array"):
        balance.ComputePartitioner().for_blocks(model, list(model.blocks), None)(list(model.blocks.named_children()), 3)
    wide = _BlockModel(wide=4096)
    rng = torch.get_rng_state()
    timed = balance.ComputePartitioner().for_blocks(wide, list(wide.blocks), example)
    assert timed.measured and torch.equal(rng, torch.get_rng_state())


class _LateHead(_BlockModel):
    """The head registered before the blocks, called after them (as OPT's decoder does with its final norm)."""

    def __init__(self) -> None:
        super().__init__()
        head = self.head
        del self.head, self.blocks
        self.head = head
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))


def test_block_profiles_count_a_module_where_the_forward_calls_it():
    model = _LateHead()
    assert [n for n, _ in model.named_children()] == ["embed", "head", "blocks"]
    prof = balance.block_profiles(model, list(model.blocks), torch.zeros(2, 8, dtype=torch.long))
    per_param = 4 * (2 + balance.OPTIMIZER_STATES)
    static = [sum(p.numel() for p in b.parameters()) * per_param for b in model.blocks]
    static[0] += model.embed.weight.numel() * per_param
    static[2] += sum(p.numel() for p in model.head.parameters()) * per_param
    assert [p[1] for p in prof] == pytest.approx(static)


def test_model_split_at_its_blocks_is_balanced_by_the_compute_partitioner():
    import lightning.pytorch as pl

    from lightning_3d.core.parallelize import plan_model

    class Module(pl.LightningModule):
        def __init__(self, example: bool) -> None:
            super().__init__()
            # block 2: 256 times the others' FLOPs; with 256 tokens per micro-batch its matmuls (about 0.2 GFLOP
            # forward + backward) outweigh every block's fixed per-operator cost many times over, so the timed
            # split isolates it on a loaded machine too (at 16 tokens all five blocks timed alike, overhead-bound)
            self.model = _BlockModel(wide=4096)
            self.example_input_array = torch.zeros(4, 64, dtype=torch.long) if example else None

        def forward(self, x):
            return self.model(x)

    uniform = plan_model(Module(True), tp=1, pp=3, partitioner="uniform")
    assert uniform.stage_plan.layer_names == [["0", "1"], ["2", "3"], ["4"]] and not uniform.stage_plan.estimates
    plan = plan_model(Module(True), tp=1, pp=3, partitioner="compute")
    assert plan.stage_plan.layer_names == [["0", "1"], ["2"], ["3", "4"]]  # the heavy block alone, timed
    assert plan.stage_plan.describe().count("ms fwd+bwd per micro-batch, measured") == 3
    memory = plan_model(Module(True), tp=1, pp=3, partitioner="memory")
    assert "MiB peak" in memory.stage_plan.describe()
    gpipe = plan_model(Module(True), tp=1, pp=3, partitioner="memory", schedule="gpipe", micro_batches=5)
    assert gpipe.stage_plan.describe().count("activations of 5 micro-batches in flight under gpipe") == 3
    with pytest.raises(ValueError, match="example_input_array"):
        plan_model(Module(False), tp=1, pp=3, partitioner="compute")


def test_memory_split_follows_the_schedules_in_flight_counts():
    """Four alike layers whose activations outweigh their parameters: under 1F1B stage 0 holds twice stage 1's
    micro-batches and gets one layer; under GPipe both hold all of them and split evenly."""
    import lightning.pytorch as pl

    from lightning_3d.core.parallelize import plan_model

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(
                *(nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 32)) for _ in range(4))
            )
            self.example_input_array = torch.zeros(512, 32)

        def forward(self, x):
            return self.body(x)

    one_f_one_b = plan_model(Module(), tp=1, pp=2, partitioner="memory", schedule="1f1b", micro_batches=4)
    assert one_f_one_b.stage_plan.layer_names == [["0"], ["1", "2", "3"]]
    gpipe = plan_model(Module(), tp=1, pp=2, partitioner="memory", schedule="gpipe", micro_batches=4)
    assert gpipe.stage_plan.layer_names == [["0", "1"], ["2", "3"]]
    assert gpipe.stage_plan.describe().count("activations of 4 micro-batches in flight under gpipe") == 2


def _tiny_llama(vocab: int, layers: int) -> Any:
    """A LightningModule holding a tiny Hugging Face Llama (hidden 16), with a 2 x 8 token example."""
    import lightning.pytorch as pl
    from transformers import AutoConfig, AutoModelForCausalLM

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            config = AutoConfig.for_model(
                "llama", vocab_size=vocab, num_hidden_layers=layers, hidden_size=16, intermediate_size=32,
                num_attention_heads=4, num_key_value_heads=2, use_cache=False,
            )  # fmt: skip
            self.model = AutoModelForCausalLM.from_config(config)
            self.example_input_array = torch.zeros(2, 8, dtype=torch.long)

        def forward(self, x):
            return self.model(input_ids=x).logits

    return Module()


@pytest.mark.parametrize("partitioner", ["memory", "compute-flops"])
def test_hugging_face_model_is_profiled_on_fake_tensors(partitioner):
    """A Hugging Face model asks a tensor's value while it builds its mask (``.all()`` on the positions), which
    meta tensors cannot answer: the memory partitioner and the compute partitioner's FLOP count profile it on fake
    tensors. The parameters count once each, as static bytes, on the block that owns them (the embedding on the
    first block, the final norm and head on the last)."""
    from lightning_3d.core.parallelize import plan_model

    chosen = balance.ComputePartitioner(measure=False) if partitioner == "compute-flops" else partitioner
    module = _tiny_llama(vocab=64, layers=4)
    plan = plan_model(module, tp=1, pp=2, partitioner=chosen, schedule="1f1b", micro_batches=2)
    assert plan.stage_plan.layer_names and len(plan.stage_plan.costs) == 2 and min(plan.stage_plan.costs) > 0
    if partitioner == "memory":
        profiles = balance.block_profiles(module, list(module.model.model.layers), torch.zeros(2, 8, dtype=torch.long))
        total = sum(p.numel() * p.element_size() for p in module.parameters()) * (2 + balance.OPTIMIZER_STATES)
        assert sum(p[1] for p in profiles) == total
        embed = module.model.model.embed_tokens.weight
        head = module.model.lm_head.weight
        block = sum(p.numel() * 4 for p in module.model.model.layers[1].parameters()) * (2 + balance.OPTIMIZER_STATES)
        assert profiles[0][1] == block + embed.numel() * 4 * (2 + balance.OPTIMIZER_STATES)
        norm = module.model.model.norm.weight
        assert profiles[-1][1] == block + (head.numel() + norm.numel()) * 4 * (2 + balance.OPTIMIZER_STATES)
        assert all(p[2] > 0 for p in profiles)


class _ResidualMLP(nn.Module):
    """A transformer-like block of the user's (so activation checkpointing picks it): ``x + proj(gelu(fc(x)))``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act, self.proj = nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)

    def forward(self, x):
        return x + self.proj(self.act(self.fc(x)))


class _LiveBytes(torch_compat.TorchDispatchMode):
    """Bytes of the tensors made under it that are still alive (by storage), and their peak, op by op."""

    def __init__(self, exclude: set[int]) -> None:
        super().__init__()
        self.made: list[tuple] = []
        self.exclude, self.peak = exclude, 0

    def live(self) -> int:
        import weakref  # noqa: F401  (the refs below)

        alive = {ptr: size for ref, ptr, size in self.made if ref() is not None and ptr not in self.exclude}
        return sum(alive.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref

        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.made.append((weakref.ref(t), t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        self.peak = max(self.peak, self.live())
        return out


@pytest.mark.parametrize("mode", [None, "full", "selective", 2])
def test_memory_estimate_follows_activation_checkpointing(mode):
    """Under activation checkpointing a block keeps only its input per micro-batch in flight (selective: also its
    matmul outputs) and rebuilds the rest in its backward. Against the bytes alive (op by op, whatever holds them)
    while a 1F1B stage's micro-batches run through torch's checkpointing, applied as the strategy applies it: the
    estimate's in-flight part matches what the forwards leave alive, and the whole estimate (with the
    recomputation) lies between that and the backward's peak."""
    from lightning_3d.core import checkpointing

    torch.manual_seed(0)
    n = 256
    layers = [(str(i), _ResidualMLP()) for i in range(4)]
    ranges = [range(0, 2), range(2, 4)]
    part = partition.get_partitioner("memory").for_input(torch.randn(n, 32))
    estimate = part.for_schedule([2, 1], "1f1b", mode).stage_costs(layers, ranges)
    without_flight = part.for_schedule([0, 0], "1f1b", mode).stage_costs(layers, ranges)  # static + recompute
    if mode is not None:
        checkpointing.checkpoint_blocks([layers[i] for i in (range(4) if mode != 2 else (1, 3))], mode)
    for s, r in enumerate(ranges):
        stage = nn.Sequential(*(layers[i][1] for i in r))
        live = _LiveBytes({p.untyped_storage().data_ptr() for p in stage.parameters()})
        with live:  # 1F1B: 2 - s micro-batches in flight (each stage's input counts: its first block keeps it)
            loss = sum(stage(torch.randn(n, 32, requires_grad=s > 0)).sum() for _ in range(2 - s))
            held = live.live()
            loss.backward()
        static = _static_bytes(stage)  # after the backward: Adam makes states for parameters with gradients
        in_flight = estimate[s] - without_flight[s]
        assert abs(in_flight - held) <= 0.1 * held, (mode, s, in_flight, held)
        # the recomputation: none without checkpointing; with it, more than nothing and no more than the backward
        # adds over what the forwards left alive (that also holds the activation gradients)
        recompute = without_flight[s] - static
        assert (recompute == 0) if mode is None else (0 < recompute <= live.peak - held), (mode, s, recompute)
        # (1% slack below: the step's scalar loss is alive too)
        assert 0.99 * (static + held) <= estimate[s] <= static + live.peak, (mode, s, estimate[s], held, live.peak)


def test_split_balances_ranks_when_a_rank_holds_several_stages():
    """Seven unit layers and a heavy last one over 4 stages. The stage split alone (slowest stage 5, 2+2+3+5) gives
    the rank of stages 1 and 3 seven units against five; moving one boundary makes both ranks six, the slowest stage
    unchanged. One stage per rank keeps the stage split."""
    costs = [1.0] * 7 + [5.0]
    layers = [(str(i), nn.Identity()) for i in range(8)]
    body = partition.BodyRef(parent=nn.Module(), attr="body", fqn="body", module=nn.Sequential(*(m for _, m in layers)))
    part = balance.ComputePartitioner(profiles=[(c, 0.0, 0.0) for c in costs])
    assert part(layers, 4) == [range(0, 2), range(2, 4), range(4, 7), range(7, 8)]  # the stage split
    looping = partition.plan_stages(body, 2, part, 2)  # stages 0, 2 on rank 0; 1, 3 on rank 1
    assert max(looping.costs) == 5.0 and looping.predicted_imbalance() == 1.0  # 6 and 6
    v_shape = partition.plan_stages(body, 2, part, 2, [0, 1, 1, 0])  # ZB-V: stages 0 and 3 on rank 0
    assert max(v_shape.costs) == 5.0 and v_shape.predicted_imbalance() == 1.0
    one_each = partition.plan_stages(body, 4, part)
    assert one_each.costs == [2.0, 2.0, 3.0, 5.0]


def test_model_split_at_its_blocks_balances_ranks_under_an_interleaved_placement():
    """A Llama whose head is heavy (vocabulary 2048 against hidden 16): under interleaved 1F1B the rank holding the
    last stage gets fewer blocks than the stage split alone would give it."""
    from lightning_3d.core.parallelize import plan_model

    module = _tiny_llama(vocab=2048, layers=10)
    part = balance.ComputePartitioner(measure=False)
    blocks = list(module.model.model.layers)
    layers = [(str(i), b) for i, b in enumerate(blocks)]
    profiled = part.for_blocks(module, blocks, module.example_input_array)
    stage_split = profiled(layers, 4)
    costs = profiled.stage_costs(layers, stage_split)
    before = max(costs[0] + costs[2], costs[1] + costs[3]) / (sum(costs) / 2)
    plan = plan_model(module, tp=1, pp=2, stages_per_rank=2, partitioner=part, schedule="interleaved1f1b")
    assert plan.stage_plan.predicted_imbalance() < before, (plan.stage_plan.layer_names, stage_split)
