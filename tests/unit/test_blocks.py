"""core/blocks.py: finding the block container, assigning the modules around it, tied weights across stages."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_3d.core.blocks import (
    find_blocks,
    layer_drop,
    outside_modules,
    split_model,
    stage_ranges_from_names,
    tied_parameters,
)


class Block(nn.Module):
    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x)


class Nano(nn.Module):
    """nanoGPT's registration order: embeddings, dropout, blocks, final norm inside a ModuleDict; head after it."""

    def __init__(self, tie: bool = False, layers: int = 4) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(8, 4),
                "drop": nn.Dropout(0.0),
                "h": nn.ModuleList(Block() for _ in range(layers)),
                "ln_f": nn.LayerNorm(4),
            }
        )
        self.small = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])  # a smaller same-type container
        self.lm_head = nn.Linear(4, 8, bias=False)
        if tie:
            self.lm_head.weight = self.transformer.wte.weight


def test_largest_container_of_same_type_blocks_is_found() -> None:
    found = find_blocks(Nano())
    assert (found.fqn, found.names, found.source) == ("transformer.h", ("0", "1", "2", "3"), "largest container")
    assert found.block_fqn("2") == "transformer.h.2"


def test_a_named_container_wins_and_bad_names_are_refused() -> None:
    assert find_blocks(Nano(), "small").fqn == "small"
    with pytest.raises(ValueError, match=r"blocks='transformer.nope'.*has no submodule"):
        find_blocks(Nano(), "transformer.nope")
    with pytest.raises(ValueError, match=r"'lm_head' is a Linear, not an nn.ModuleList"):
        find_blocks(Nano(), "lm_head")


def test_mixed_types_only_count_as_a_sequential() -> None:
    mixed_list = nn.Module()
    mixed_list.layers = nn.ModuleList([nn.Linear(4, 4), nn.LayerNorm(4)])
    with pytest.raises(ValueError, match=r"has no block container to split.*blocks='attribute.path'"):
        find_blocks(mixed_list)
    seq = nn.Module()
    seq.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert find_blocks(seq).fqn == "body"


def test_hugging_face_pp_plan_names_the_container() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(
        "llama", num_hidden_layers=2, hidden_size=8, intermediate_size=16, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=16,
    )  # fmt: skip
    root = nn.Module()
    root.model = transformers.AutoModelForCausalLM.from_config(config)
    found = find_blocks(root)
    assert (found.fqn, found.source) == ("model.model.layers", "hugging face pp plan")
    before, after = outside_modules(root, found)
    assert before == ["model.model.embed_tokens"]
    assert after == ["model.model.norm", "model.lm_head"]  # run order: the inner norm, then the head


def test_layer_drop_is_found_on_the_modules_that_skip_their_layers() -> None:
    transformers = pytest.importorskip("transformers")
    sizes = dict(d_model=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                 encoder_ffn_dim=16, decoder_ffn_dim=16, vocab_size=16, max_position_embeddings=16)  # fmt: skip
    root = nn.Module()
    root.model = transformers.AutoModelForSeq2SeqLM.from_config(transformers.M2M100Config(**sizes))  # 0.05 each
    found = layer_drop(root)
    assert found == [("model.model.encoder", 0.05), ("model.model.decoder", 0.05)]
    off = transformers.M2M100Config(**sizes, encoder_layerdrop=0.0, decoder_layerdrop=0.0)
    root.model = transformers.AutoModelForSeq2SeqLM.from_config(off)
    assert layer_drop(root) == []


def test_modules_around_the_container_go_first_and_last() -> None:
    model = Nano()
    before, after = outside_modules(model, find_blocks(model))
    assert before == ["transformer.wte"]  # the dropout has no parameters: on every stage
    assert after == ["transformer.ln_f", "small", "lm_head"]


def test_modules_the_forward_calls_after_the_blocks_go_last_whatever_their_registration() -> None:
    model = Nano()
    before, after = outside_modules(model, find_blocks(model), called_after={"transformer.wte"})
    assert before == []
    assert after == ["transformer.wte", "transformer.ln_f", "small", "lm_head"]
    split = split_model(model, find_blocks(model), 2, [range(0, 1), range(1, 2)], called_after={"transformer.wte"})
    assert split.stage_of("transformer.wte") == 1


def test_modules_the_forward_calls_before_the_blocks_go_first_whatever_their_registration() -> None:
    """BART's decoder registers its embedding norm after its layers and runs it before them."""
    model = Nano()
    before, after = outside_modules(model, find_blocks(model), called_before={"transformer.ln_f"})
    assert before == ["transformer.wte", "transformer.ln_f"]
    assert after == ["small", "lm_head"]
    split = split_model(model, find_blocks(model), 2, [range(0, 1), range(1, 2)], called_before={"transformer.ln_f"})
    assert split.stage_of("transformer.ln_f") == 0


def test_parameters_owned_directly_are_refused() -> None:
    model = Nano()
    model.scale = nn.Parameter(torch.ones(()))
    with pytest.raises(ValueError, match=r"Nano owns parameters directly \(\['scale'\]\)"):
        outside_modules(model, find_blocks(model))


def test_split_assigns_blocks_and_outside_modules_to_stages() -> None:
    model = Nano()
    container = find_blocks(model)
    split = split_model(model, container, pp=2, ranges=[range(0, 3), range(3, 4)])
    assert split.stage_blocks == [["0", "1", "2"], ["3"]] and split.stage_to_rank == [0, 1]
    assert split.modules_of(0) == ["transformer.wte", "transformer.h.0", "transformer.h.1", "transformer.h.2"]
    assert split.modules_of(1) == ["transformer.h.3", "transformer.ln_f", "small", "lm_head"]
    assert split.tied == [] and split.aliases == []
    interleaved = split_model(model, container, pp=2, ranges=[range(i, i + 1) for i in range(4)], stages_per_rank=2)
    assert interleaved.stage_to_rank == [0, 1, 0, 1]
    lines = split.describe(["3.00 ms", "1.00 ms"]).splitlines()  # the compute / memory partitioner's estimates
    assert lines[0] == "  stage 0 on pp rank 0: transformer.wte + transformer.h[0..2] (largest container) (3.00 ms)"
    assert lines[1].endswith("transformer.h[3] (largest container) + transformer.ln_f, small, lm_head (1.00 ms)")
    assert "ms" not in split.describe()


def test_weights_tied_across_first_and_last_stage_are_reported() -> None:
    model = Nano(tie=True)
    assert tied_parameters(model) == [("transformer.wte.weight", "lm_head.weight")]
    split = split_model(model, find_blocks(model), pp=2, ranges=[range(0, 2), range(2, 4)])
    assert split.tied == [("transformer.wte.weight", "lm_head.weight")]
    one_stage = split_model(model, find_blocks(model), pp=1, ranges=[range(0, 4)])
    assert one_stage.tied == [] and one_stage.aliases == [("transformer.wte.weight", "lm_head.weight")]
    assert "tied across stages: transformer.wte.weight = lm_head.weight" in split.describe()


def test_weights_shared_with_a_middle_stage_are_refused() -> None:
    model = Nano()
    model.transformer.h[2].fc.weight = model.lm_head.weight  # block 2 is on the middle stage
    with pytest.raises(ValueError, match=r"shared by modules on pipeline stages \[1, 2\]"):
        split_model(model, find_blocks(model), pp=3, ranges=[range(0, 2), range(2, 3), range(3, 4)])


# ---------------------------------------------------------------------------------------------- stages=


def _split_by_names(model: nn.Module, stages: list[list[str]], pp: int | None = None, per_rank: int = 1):
    container = find_blocks(model)
    ranges, placement = stage_ranges_from_names(model, container, stages, len(stages))
    return split_model(model, container, pp or len(stages), ranges, per_rank, placement)


def test_stages_give_uneven_blocks_and_default_outside_modules() -> None:
    split = _split_by_names(Nano(), [["transformer.h.0"], ["transformer.h.1", "transformer.h.2", "transformer.h.3"]])
    assert split.stage_blocks == [["0"], ["1", "2", "3"]] and split.placement == {}
    assert split.modules_of(0) == ["transformer.wte", "transformer.h.0"]
    assert split.modules_of(1) == ["transformer.h.1", "transformer.h.2", "transformer.h.3", "transformer.ln_f", "small",
                                   "lm_head"]  # fmt: skip


def test_stages_place_named_outside_modules() -> None:
    stages = [
        ["transformer.wte", "transformer.h.0", "transformer.h.1", "small"],
        ["transformer.h.2"],
        ["transformer.h.3", "transformer.ln_f", "lm_head"],
    ]
    split = _split_by_names(Nano(), stages)
    assert split.placement == {"transformer.wte": 0, "small": 0, "transformer.ln_f": 2, "lm_head": 2}
    assert split.modules_of(0) == ["transformer.wte", "transformer.h.0", "transformer.h.1", "small"]
    assert split.modules_of(1) == ["transformer.h.2"]
    assert split.modules_of(2) == ["transformer.h.3", "transformer.ln_f", "lm_head"]
    assert (split.stage_of("small"), split.stage_of("transformer.h.2")) == (0, 1)
    assert "stage 0 on pp rank 0: transformer.wte + transformer.h[0..1] (largest container) + small" in split.describe()


def test_stages_interleaved_assign_ranks_in_a_loop() -> None:
    split = _split_by_names(Nano(), [[f"transformer.h.{i}"] for i in range(4)], pp=2, per_rank=2)
    assert split.stage_to_rank == [0, 1, 0, 1] and split.stage_blocks == [["0"], ["1"], ["2"], ["3"]]


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ([["transformer.h.0", "transformer.h.1", "transformer.h.2", "transformer.h.3"]],
         r"stages=\.\.\.\) has 1 lists but there are 2 pipeline stages"),
        ([["transformer.h.0", "transformer.h.1"], ["transformer.h.2", "transformer.h.3", "lm_haed"]],
         r"names 'lm_haed', which is not a module of the LightningModule\. Did you mean 'lm_head'\?"),
        ([["transformer.h.0", "transformer.h.1"], ["transformer.h.2", "transformer.h.3", "transformer.h.3.fc"]],
         r"'transformer.h.3.fc', which is inside a block of 'transformer.h': a stage holds whole blocks"),
        ([["transformer.drop", "transformer.h.0", "transformer.h.1"], ["transformer.h.2", "transformer.h.3"]],
         r"'transformer.drop', which has no parameters: such modules run on every stage; leave it out"),
        ([["transformer", "transformer.h.0", "transformer.h.1"], ["transformer.h.2", "transformer.h.3"]],
         r"'transformer', which contains the block container 'transformer.h'"),
        ([["transformer.h.0", "transformer.h.1"], ["transformer.h.1", "transformer.h.2", "transformer.h.3"]],
         r"names 'transformer.h.1' twice \(stage 0 and stage 1\)"),
        ([["transformer.h.0", "transformer.h.1"], ["transformer.h.2"]],
         r"leaves out transformer.h.3 of 'transformer.h': every block must be named"),
        ([["transformer.wte", "lm_head"], ["transformer.h.0", "transformer.h.1", "transformer.h.2", "transformer.h.3"]],
         r"stage 0 holds no block of 'transformer.h' \(\['transformer.wte', 'lm_head'\]\)"),
        ([["transformer.h.0", "transformer.h.2"], ["transformer.h.1", "transformer.h.3"]],
         r"must be contiguous and in order over the stages.*stage 0: transformer.h.0, transformer.h.2; stage 1"),
        ([["transformer.h.2", "transformer.h.3"], ["transformer.h.0", "transformer.h.1"]],
         r"must be contiguous and in order"),
    ],
)  # fmt: skip
def test_stages_are_checked_with_clear_messages(stages: list[list[str]], message: str) -> None:
    model = Nano()
    with pytest.raises(ValueError, match=message):
        stage_ranges_from_names(model, find_blocks(model), stages, 2)


def test_stages_that_move_a_tied_weight_to_a_middle_stage_are_refused() -> None:
    stages = [["transformer.wte", "transformer.h.0"], ["transformer.h.1", "transformer.h.2", "lm_head"],
              ["transformer.h.3"]]  # fmt: skip
    with pytest.raises(ValueError, match=r"shared by modules on pipeline stages \[0, 1\]"):
        _split_by_names(Nano(tie=True), stages)
