"""core/carry.py across processes: encoder-decoders whose later pipeline stages read an earlier stage's module
outputs train and validate as on one device.

scripts/carry_run.py fits a Hugging Face T5, a FLAN-T5 (T5 v1.1: gated MLP, untied head) and a BART (4 decoder
blocks, the pipeline's blocks; the encoder on the first stage) in float64, at pp2, tp2 x pp2 (ZB-V) and pp2 x dp2
(FSDP), with sanity validation (the evaluation hook's first batch comes first) and validation every 2 steps, then
validates once more. The later stages read the encoder's output (every decoder block's cross-attention) and T5's
position biases (returned by the first decoder block for the others), carried across the boundaries besides the
flowing activation: up to the last stage through the middle ones at four stages. Each value is compared with one
process running the same model and batches, relative 1e-10 (float64).
"""

from __future__ import annotations

import pytest
import torch

from launch import run_lightning

pytest.importorskip("transformers")

CASES = ("t5", "flant5", "bart")
# blocks the model skips while training (LayerDrop), the same ones on one device: NanoGPT skipping by a pattern of the
# step (a stage's last block, all of the last stage's, all of the first's: at four stages a middle stage's too), and
# an M2M100 whose config skips every decoder layer in training (its encoder's output, carried, then reaches no block)
SKIPPING = ("skipgpt", "m2m_100")
# steps reading Hugging Face's outputs.hidden_states (every layer's, recorded by hooks on the layers): the last stage's
# stand-ins for the first stage's layers record the values carried from there; and one whose loss also reads every
# layer's attention weights (recorded inside the layers: carried from the stage that ran the layer, since 2026-12-06)
HIDDEN = ("bert-hs", "llama-hs", "llama-attn")
# a Mixtral whose loss adds the load-balancing loss over every layer's router logits (recorded by hooks on the routers
# inside the layers), per micro-batch (models.RouterAux): in the layouts without data parallelism
ROUTER = ("mixtral-aux",)
# relative tolerance per case (1e-10 otherwise): Mixtral's router takes the softmax of its logits in float32 (also in
# a float64 model), so its loss is rounded to float32 there, and round-off-sized differences upstream (another order
# of the same float64 additions) move it by one float32 ulp (4.8e-7 at a loss of 4.5) now and then. A missing layer's
# router logits move the load-balancing term by 1e-2.
TOLERANCE = {"mixtral-aux": 1e-6}
LAYOUTS = {
    # (tp, pp, dp, schedule, stages per rank): two stages; four stages on two ranks in a V, with tensor parallelism;
    # two stages under FSDP over two replicas
    "pp2-1f1b": (1, 2, 1, "1f1b", 1),
    "tp2-pp2-zbv": (2, 2, 1, "zbvzerobubble", 2),
    "pp2-dp2-fsdp": (1, 2, 2, "1f1b", 1),
}
# tensor parallelism alone: attention weights recorded there hold the rank's heads unless gathered
TP_ONLY = {"tp2": (2, 1, 1, "1f1b", 1)}


@pytest.fixture(scope="module")
def carry_reference(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("carry_ref")
    cases = ",".join(CASES + SKIPPING + HIDDEN + ROUTER)
    run_lightning("carry_run.py", ["--ref", "--cases", cases, "--out", out], timeout=240)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_encoder_decoders_train_and_validate_as_on_one_device(carry_reference, tmp_path, layout):
    check_layout(carry_reference, tmp_path, layout, CASES)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_blocks_skipped_while_training_train_as_on_one_device(carry_reference, tmp_path, layout):
    """Before 2026-12-05 a skipped first block left its stage's received activation unused and a skipped last
    block ran the step on past the stage (*"model.transformer.ln_f is held by pipeline stage 1, but stage 0 reached
    it before its blocks"*); M2M100 with LayerDrop could not be checked on fake tensors (``torch.rand([]) <
    layerdrop``) and died with *"a skip connection crosses the stage boundary between model.model.encoder and
    model.model.decoder.layers.2"*."""
    check_layout(carry_reference, tmp_path, layout, SKIPPING)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hidden_states_read_by_the_step_are_the_layers_own(carry_reference, tmp_path, layout):
    """Before 2026-12-05 the last stage's ``hidden_states`` (transformers 5 records them with hooks on the layers)
    left out the layers other stages hold: 3 of 5 at pp2, a wrong mean without a word (the test models assert the
    count); step-1 gradients were 1e-4 off one device's. In the same runs, without data parallelism (its
    load-balancing loss is per replica, as DDP's): until 2026-12-05 Mixtral's load-balancing loss at pp > 1 counted
    the last stage's routers only (their logits are recorded by hooks inside the layers), silently; then it was
    refused; now the earlier stages' router logits are carried to the last stage, their gradients back."""
    dp = LAYOUTS[layout][2]
    check_layout(carry_reference, tmp_path, layout, HIDDEN + (ROUTER if dp == 1 else ()))


@pytest.mark.slow
def test_attention_weights_under_tensor_parallelism_hold_every_head(carry_reference, tmp_path):
    """Until 2026-12-06 the attention weights Hugging Face records (``output_attentions=True``) held the rank's heads
    under tensor parallelism, at pp = 1 too: the penalty on them was another number on each rank (1e-8 off one
    device's), silently. They are gathered over the tensor-parallel ranks now (``hf_outputs.gather_recorded_heads``);
    tp2 x pp2 above covers them carried across stages."""
    check_layout(carry_reference, tmp_path, "tp2", ("llama-attn",))


def check_layout(carry_reference, tmp_path, layout: str, cases: tuple[str, ...]) -> None:
    tp, pp, dp, schedule, per_rank = {**LAYOUTS, **TP_ONLY}[layout]
    args = ["--tp", tp, "--pp", pp, "--dp", dp, "--schedule", schedule, "--stages-per-rank", per_rank]
    args += ["--data-parallel", "fsdp" if dp > 1 else "replicate"]
    run_lightning(
        "carry_run.py", [*args, "--cases", ",".join(cases), "--init", carry_reference, "--out", tmp_path], timeout=300
    )
    for case in cases:
        ref = torch.load(carry_reference / f"carry_{case}.pt")
        got = torch.load(tmp_path / f"carry_{case}.pt")
        assert len(ref["train"]) == len(got["train"]) == 4 and len(ref["val"]) == len(got["val"]) == 4, (ref, got)
        rel = TOLERANCE.get(case, 1e-10)
        for what in ("train", "val"):
            for step, (r, g) in enumerate(zip(ref[what], got[what], strict=True)):
                assert g == pytest.approx(r, rel=rel), f"{case} {what} {step}: {g} vs {r}"
        assert got["validate"] == pytest.approx(ref["validate"], rel=rel), case
        assert len(set(ref["train"])) > 1  # the model learns: a later value depends on the earlier steps' gradients
