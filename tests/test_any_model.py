"""Models as people write them train under ThreeDStrategy with single-device numbers.

Not one nn.Sequential: a nanoGPT-style model (blocks in an nn.ModuleList inside an nn.ModuleDict, untied and with
the LM head tied to the token embedding) and unmodified Hugging Face causal LMs (Llama: GQA, RoPE, SwiGLU, RMSNorm;
Qwen3: q/k norms; GPT-2: Conv1D, learned positions, tied embeddings; OPT: no pipeline plan of its own, final norm
registered before the blocks; StableLM: no tensor-parallel plan of its own), each wrapped in a LightningModule whose
training_step calls the model as usual (``self.model(input_ids=x, labels=x).loss``). Every layout is checked
against one process on the same global batches (tests/scripts/parity_run.py): float64 step-1 gradients within
1e-10 and float32 20-step curves (Adam, clipping, LR schedule) within 1e-4 relative, data-parallel replicas
bitwise identical.
"""

from __future__ import annotations

import pytest

from conftest import copy_inits
from launch import run_lightning
from parity_check import check_replicas, compare, load, schedule_tags

HF = (
    "llama",
    "qwen3",
    "gpt2",
    "opt",
    "stablelm",
    "apertus",
    "gptj",
    "falcon",
    "hunyuan",
    "bertcls",
    "vit",
    "modernbert",
)


def precision_of(case: str) -> str:
    bits = case[-2:]
    return f"{bits}hf" if bits == "64" and case.startswith(HF) else bits


# (tp, pp, dp): cases. tp2 x pp2 x dp2 runs every model in both precisions; the other layouts a selection.
LAYOUTS = {
    (2, 2, 2): [
        "nano64",
        "nano32",
        "nanotied64",
        "nanotied32",
        "llama64",
        "llama32",
        "qwen364",
        "gpt264",
        "gpt232",
        "llamameta64",
        "gpt2meta64",
        "stablelm32",  # attention with its head counts set per rank (GQA), 20 steps
    ],
    # without data parallelism the tied weights are DTensors over tp alone, and Llama's vocabulary-sharded
    # embedding gets its gradient back replicated: the sum across the pipeline ends must take the same shard;
    # rotary: blocks called with the rotary tables too (the tensor-parallel analysis runs them with those);
    # nanotiedmeta: built on the meta device, its head re-tied to the sharded embedding on the last stage;
    # opt: its final norm and output projection, registered before the blocks, go with the last stage (the
    # forward on the model's dummy inputs shows they run after the blocks); stablelm: no plan of its own, its
    # blocks (called with the rotary tables and the mask) and its embedding and head analysed on its dummy inputs;
    # optmeta: the same analysis on the meta device; apertus: its plan leaves out the MLP's learned activation;
    # gptjmeta: its rotary table, a non-persistent buffer, computed again in float64 when materialised; falcon: its
    # Linear subclasses sharded as Linears, the fused q/k/v split by key/value group (num_kv_heads set per rank);
    # hunyuan: its own plan names only the embedding and the head (kept), the blocks get the automatic plan
    (2, 2, 1): [
        "llamatied64",
        "rotary64",
        "rotary32",
        "nanotiedmeta64",
        "nanockpt64",  # each block called through torch.utils.checkpoint by the forward itself
        "opt64",
        "optmeta64",
        "stablelm64",
        "apertus64",
        "gptjmeta64",
        "falcon64",
        "hunyuan64",
        # encoder and vision models: a BERT sequence classifier, a ViT image classifier (its forward reads the patch
        # embedding's weight dtype on every stage), a ModernBERT masked LM (its forward reads each layer's attention
        # type and unpacks a tuple from each layer)
        "bertcls64",
        "vit64",
        "modernbert64",
        "swin64",  # its stages, split over the pipeline, return tuples its encoder unpacks
    ],
    (1, 4, 2): ["nano32", "nanotied64", "llama64", "qwen364", "gpt264"],
    # meta: head re-tied to a sharded embedding; plain: no block container (the whole module analysed)
    (2, 1, 2): ["nano64", "llama32", "qwen364", "gpt264", "gpt2meta64", "plain64", "plain32"],
    (1, 1, 4): ["nanotied32", "llama64", "gpt264"],
}
ALL_CASES = sorted({c for cases in LAYOUTS.values() for c in cases})

# Which parameters tensor parallelism shards (written out here, independently of the planners): the Megatron pairs
# of the automatic plan (nanoGPT blocks: q/k/v/fc column-parallel, out_proj/proj weights row-parallel) and the
# Hugging Face models' own plans (GPT-2's: MLP only, attention replicated; embeddings and head on the vocabulary).
SHARDED = {
    "nano": ("q_proj.", "k_proj.", "v_proj.", "fc.", "out_proj.weight", ".proj.weight"),
    "llama": (
        "q_proj.",
        "k_proj.",
        "v_proj.",
        "o_proj.weight",
        "gate_proj.",
        "up_proj.",
        "down_proj.weight",
        "embed_tokens.weight",
        "lm_head.weight",
    ),
    "gpt2": ("mlp.c_fc.", "mlp.c_proj.weight", "wte.weight", "lm_head.weight"),
    # no plan of its own, no example: the automatic plan, run on the model's dummy_inputs. The attention reshapes
    # by its whole head count (`view(bsz, -1, self.num_heads, ...)`): sharded, with num_heads (StableLM: and
    # num_key_value_heads, GQA 4/2) set to the rank's heads; OPT's head stays whole with the embedding it is tied to
    # (the analysis pairs project_out with it row-parallel, unlike the embedding's vocabulary split), project_out
    # gathers its output
    "opt": ("q_proj.", "k_proj.", "v_proj.", "out_proj.weight", "fc1.", "fc2.weight", "project_out."),
    # its own plan: attention, MLP (fc_in / fc_out), the embedding on the vocabulary, the head (with its bias) gathered
    "gptj": ("q_proj.", "k_proj.", "v_proj.", "out_proj.weight", "fc_in.", "fc_out.weight", "wte.weight", "lm_head."),
    # the automatic plan: attention (fused q/k/v by key/value group) and MLP, embedding and head (dummy inputs)
    "falcon": (
        "query_key_value.",
        "self_attention.dense.weight",
        "dense_h_to_4h.",
        "dense_4h_to_h.weight",
        "word_embeddings.weight",
        "lm_head.weight",
    ),
    # blocks that take the rotary tables too: the analysis runs them as the model's forward calls them; with its
    # example_input_array the embedding (vocabulary-parallel) and the head (all-gathered) outside the blocks too
    "rotary": (".wq.", ".wk.", ".wv.", ".wo.", ".w1.", ".w3.", ".w2.", "tok.weight", "out.weight"),
    # no container: the MLP pair and the final projection (all-gathered)
    "plain": ("fc1.", "fc2.weight", "head."),
}
# nanotied has an example_input_array: the embeddings and the head tied to the token embedding, on the vocabulary
SHARDED["nanotied"] = (*SHARDED["nano"], "wte.weight", "wpe.weight", "lm_head.weight")
SHARDED["qwen3"] = SHARDED["llamatied"] = SHARDED["llama"]
SHARDED["nanockpt"] = SHARDED["nano"]
# stablelm: the automatic plan (see opt above) shards what Llama's own plan does; apertus: its own plan, no gate (the
# q/k norms and the learned activation between up and down replicated, their gradients summed over tp)
SHARDED["stablelm"] = SHARDED["llama"]
# hunyuan: the automatic plan of its blocks shards what Llama's plan does (its per-head q/k norms replicated, their
# gradients summed over tp), its own plan the embedding and the head
SHARDED["hunyuan"] = SHARDED["llama"]
SHARDED["apertus"] = tuple(key for key in SHARDED["llama"] if key != "gate_proj.")
# encoders, all the automatic plan: BERT's attention and MLP pairs, the pooler / classifier pair and its three
# embeddings; ViT's attention and MLP pairs (the patch convolution and the classifier whole); ModernBERT's fused
# q/k/v and gated MLP input stay whole (the layout says why), and so do the MLP outputs they feed, except the last
# block's, whose output leaves the blocks (sharded, its output all-gathered); the token embedding and the MLM decoder
# tied to it are split on the vocabulary
SHARDED["bertcls"] = (
    ".query.",
    ".key.",
    ".value.",
    "output.dense.weight",
    "intermediate.dense.",
    "pooler.dense.",
    "classifier.weight",
    "word_embeddings.",
    "position_embeddings.",
    "token_type_embeddings.",
)
SHARDED["vit"] = ("q_proj.", "k_proj.", "v_proj.", "o_proj.weight", "fc1.", "fc2.weight")
SHARDED["modernbert"] = ("tok_embeddings.weight", "decoder.", "layers.3.mlp.Wo.weight")
SHARDED["swin"] = ()  # its stages cannot run alone for the analysis: every matrix whole (the layout says why)


def check_shares(got: dict, ref: dict, model: str, tp: int) -> list[str]:
    """Each rank's parameters are its share: tensor-parallel ones split tp ways, the rest whole."""
    problems = []
    full = {name: t.numel() for name, t in ref["params"].items()}
    for rank in got["ranks"]:
        for name, numel in rank["numels"].items():
            if name not in full:
                problems.append(f"rank {rank['coords']} holds unknown parameter {name}")
                continue
            sharded = tp > 1 and any(key in name for key in SHARDED[model])
            want = full[name] // (tp if sharded else 1)
            if numel != want:
                problems.append(f"rank {rank['coords']}: {name} has {numel} elements, expected {want}")
    return problems


@pytest.fixture(scope="module")
def any_reference(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("any_ref")
    run_lightning("parity_run.py", ["--ref", "--cases", ",".join(ALL_CASES), "--out", out], timeout=300)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp", "dp"), list(LAYOUTS), ids=[f"tp{t}-pp{p}-dp{d}" for t, p, d in LAYOUTS])
def test_any_model_matches_single_device(any_reference, tmp_path, tp, pp, dp):
    cases = LAYOUTS[(tp, pp, dp)]
    copy_inits(any_reference, tmp_path)
    run_lightning(
        "parity_run.py",
        ["--tp", tp, "--pp", pp, "--dp", dp, "--micro", 4, "--cases", ",".join(cases), "--out", tmp_path],
        timeout=420,
    )
    problems = []
    for case in cases:
        ref, got = load(any_reference, case), load(tmp_path, case)
        model = case[:-2].replace("meta", "")
        found = compare(ref, got, precision_of(case)) + check_replicas(got) + check_shares(got, ref, model, tp)
        problems += [f"{case}: {p}" for p in found]
    assert not problems, "\n".join(problems[:40])


@pytest.mark.slow
def test_interleaved_schedule_on_split_models(any_reference, tmp_path):
    """Two stages per rank (interleaved 1F1B, four stages over pp=2): a rank runs stage 0 and stage 2 of nanoGPT
    with the other's blocks stood in for; with tied embeddings the first and last stage are on different ranks."""
    cases = ["nano64", "nanotied64"]
    copy_inits(any_reference, tmp_path)
    run_lightning(
        "parity_run.py",
        ["--pp", 2, "--schedule", "interleaved1f1b", "--stages-per-rank", 2, "--micro", 4, "--cases", ",".join(cases),
         "--out", tmp_path],
        timeout=300,
    )  # fmt: skip
    problems = []
    for case in cases:
        got = load(tmp_path, case)
        problems += [f"{case}: {p}" for p in compare(load(any_reference, case), got, "64") + check_replicas(got)]
    assert not problems, "\n".join(problems[:40])


@pytest.mark.slow
def test_zero_bubble_and_v_schedules_on_split_models(any_reference, tmp_path):
    """Every stage runs the user's step with the backward split into input- and weight-gradient actions; under the V
    schedules rank 0 holds the first and the last stage, so a tied embedding and head are one tensor there; under
    ZB-H1 (``interleavedzerobubble`` over one stage per rank) they are on the two ranks, as under 1F1B."""
    cases = ["nano64", "nanotied64"]
    runs = [("interleavedzerobubble", 2), ("zbvzerobubble", 2), ("dualpipev", 2), ("interleavedzerobubble", 1)]
    copy_inits(any_reference, tmp_path)
    run_lightning(
        "parity_run.py",
        ["--pp", 2, "--schedules", ",".join(f"{n}:{v}" for n, v in runs), "--micro", 4, "--cases", ",".join(cases),
         "--out", tmp_path],
        timeout=420,
    )  # fmt: skip
    problems = []
    for (name, _), tag in zip(runs, schedule_tags(runs)):
        for case in cases:
            got = load(tmp_path, f"{case}@{tag}")
            found = compare(load(any_reference, case), got, "64") + check_replicas(got)
            problems += [f"{name} {case}: {p}" for p in found]
    assert not problems, "\n".join(problems[:40])


@pytest.mark.slow
@pytest.mark.parametrize("dp", [2, 1], ids=["tp2-pp2-dp2-fsdp", "tp2-pp2-dp1"])
def test_v_schedule_with_tied_weights_under_tensor_parallelism_and_fsdp(any_reference, tmp_path, dp):
    """``dualpipev`` at tp2 x pp2 x dp2 under FSDP, and at tp2 x pp2 alone: rank 0 holds the first and the last
    stage, so the embedding and the head tied to it are wrapped by two stages there; each stage gets its own copy
    (a tensor-parallel DTensor, sharded again by its own FSDP unit at dp2) and the two gradients are summed on the
    rank (``core/tied.py``). nanoGPT tied (its example_input_array: the automatic plan shards the pair on the
    vocabulary), GPT-2 built on the meta device (its own plan shards both on the vocabulary; the copies are
    materialised as shards and take the pretrained values) and GPT-2 in float32: float64 gradients within 1e-10
    and the float32 20-step curve within 1e-4 against one process. (The resume test below runs GPT-2 under
    ``zbvzerobubble`` with replicated data parallelism at tp2 x pp2 x dp2.)"""
    cases = ["nanotied64", "gpt2meta64", "gpt232"]
    copy_inits(any_reference, tmp_path)
    run_lightning(
        "parity_run.py",
        ["--tp", 2, "--pp", 2, "--dp", dp, "--data-parallel", "fsdp" if dp > 1 else "replicate",
         "--schedules", "dualpipev:2", "--micro", 4, "--cases", ",".join(cases), "--out", tmp_path],
        timeout=480,
    )  # fmt: skip
    problems = []
    for case in cases:
        found = compare(load(any_reference, case), load(tmp_path, f"{case}@dualpipev"), precision_of(case))
        problems += [f"{case}: {p}" for p in found]
    assert not problems, "\n".join(problems[:40])


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _max_rel(got: dict, want: dict) -> float:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    return max(((got[k] - want[k]).norm() / want[k].norm().clamp_min(1e-12)).item() for k in want)


@pytest.mark.slow
def test_hf_checkpoints_resume_and_reshard(tmp_path):
    """Llama and GPT-2 (tied embeddings) in float64: save at tp2 x pp2 x dp2 (Llama under 1F1B; GPT-2 under
    ``zbvzerobubble``, whose V puts the embedding and the tied head on rank 0, each stage with its own copy there),
    resume bitwise there, load at tp1 x pp4 x dp2 under 1F1B (parameters and optimizer states exactly), and
    validation (loss and a torchmetrics accuracy) as single-device training gives it."""
    models = ["llama", "gpt2"]
    run_lightning("any_ckpt.py", ["--phase", "single", "--models", ",".join(models), "--out", tmp_path], timeout=240)
    run_lightning(
        "any_ckpt.py",
        ["--phase", "save", "--tp", 2, "--pp", 2, "--dp", 2, "--models", ",".join(models), "--v-models", "gpt2",
         "--out", tmp_path],
        timeout=420,
    )  # fmt: skip
    run_lightning(
        "any_ckpt.py",
        ["--phase", "reshard", "--tp", 1, "--pp", 4, "--dp", 2, "--models", ",".join(models), "--out", tmp_path],
        timeout=420,
    )
    for name in models:
        single = load(tmp_path, f"{name}-single")
        saved = load(tmp_path, f"{name}-save")
        reshard = load(tmp_path, f"{name}-reshard")
        # 6 steps at tp2 x pp2 x dp2 follow single-device training (HF's loss is float32: 1e-6)
        assert all(_rel(g, r) < 1e-6 for g, r in zip(saved["fit"]["losses"], single["fit"]["losses"], strict=True))
        # same layout: steps 4-6 after resuming from step 3 are the first run's, bit for bit
        assert saved["resume"]["losses"] == saved["fit"]["losses"][3:], (saved["resume"], saved["fit"]["losses"])
        # another layout: the restored parameters and optimizer states are the checkpoint's, exactly
        for part in ("params", "opt"):
            assert _max_rel(reshard["resume"]["snap_start"][part], saved["resume"]["snap_start"][part]) == 0.0
        assert _max_rel(reshard["resume"]["snap_end"]["params"], single["fit"]["snap_end"]["params"]) < 1e-10
        assert all(_rel(g, r) < 1e-6 for g, r in zip(reshard["resume"]["losses"], saved["fit"]["losses"][3:]))
        for rec in (saved, reshard):
            assert _rel(rec["validate"]["val_loss"], single["validate"]["val_loss"]) < 1e-6, rec["validate"]
            assert rec["validate"]["val_acc"] == single["validate"]["val_acc"], rec["validate"]
        # the step-6 checkpoint exported as a Hugging Face folder: from_pretrained gives the trained weights, and
        # LoadWeights(folder) starts a tp1 x pp4 x dp2 run from them
        trained = saved["fit"]["snap_end"]["params"]
        assert _max_rel(saved["hf_params"], trained) == 0.0
        assert _max_rel(reshard["from_hf"], trained) == 0.0


@pytest.mark.slow
def test_explicit_stages_give_single_device_numbers(any_reference, tmp_path):
    """``stages=`` at pp2 x dp2 (the names a user writes): one block on the first stage with the embeddings, three
    on the last with the final norm and the head (the uniform partitioner would split 2 + 2). nanoGPT with its head
    tied to the embedding across the two stages, and the Hugging Face Llama; both with an ``example_input_array``,
    so the stage boundaries are also checked at setup on fake tensors (and pass)."""
    cases = ["nanotied64", "llama64"]
    copy_inits(any_reference, tmp_path)
    result = run_lightning(
        "parity_run.py",
        ["--pp", 2, "--dp", 2, "--stages", "--micro", 4, "--cases", ",".join(cases), "--out", tmp_path],
        timeout=300,
    )
    layouts = [
        "stage 0 on pp rank 0: transformer.wte, transformer.wpe + transformer.h[0] (largest container)",
        "stage 1 on pp rank 1: model.model.layers[1..3] (hugging face pp plan) + model.model.norm, model.lm_head",
    ]
    assert all(layout in result.output for layout in layouts), result.tail(60)
    assert "could not run on fake tensors" not in result.output, result.tail(60)
    problems = []
    for case in cases:
        got = load(tmp_path, case)
        ref = load(any_reference, case)
        found = compare(ref, got, precision_of(case)) + check_replicas(got) + check_shares(got, ref, case[:-2], 1)
        problems += [f"{case}: {p}" for p in found]
    assert not problems, "\n".join(problems[:40])
