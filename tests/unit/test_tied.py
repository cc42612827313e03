"""core/tied.py: a tied weight named once in state dicts and checkpoints; re-tying after one-at-a-time allocation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_3d.core.materialize import library_initializers, materialize
from lightning_3d.core.tied import canonical_names, embedding_groups, install_alias_hooks, retie, with_alias_keys


def tied() -> nn.Module:
    root = nn.Module()
    root.embed = nn.Embedding(8, 4)
    root.head = nn.Linear(4, 8, bias=False)
    root.head.weight = root.embed.weight
    return root


def test_state_dict_names_a_tied_weight_once_and_loads_back() -> None:
    root = tied()
    install_alias_hooks(root, [("embed.weight", "head.weight")])
    assert canonical_names(root) == {"head.weight": "embed.weight"}
    state = root.state_dict()
    assert list(state) == ["embed.weight"]
    other = tied()
    install_alias_hooks(other, [("embed.weight", "head.weight")])
    assert not other.load_state_dict(state).missing_keys
    assert torch.equal(other.head.weight, state["embed.weight"]) and other.head.weight is other.embed.weight


def test_a_whole_state_dict_gets_the_alias_keys_a_plain_copy_of_the_model_loads() -> None:
    """``strategy.full_state_dict()``: named once while gathered, both names for a plain single-device copy."""
    root = tied()
    install_alias_hooks(root, [("embed.weight", "head.weight")])
    state = with_alias_keys(root.state_dict(), root)
    assert list(state) == ["embed.weight", "head.weight"] and state["head.weight"] is state["embed.weight"]
    plain = tied()  # no hooks: its state_dict() has both names, load_state_dict wants both
    assert set(state) == set(plain.state_dict())
    plain.load_state_dict(state)
    assert torch.equal(plain.head.weight, root.embed.weight)
    assert list(with_alias_keys({"x": torch.ones(1)}, nn.Linear(1, 1))) == ["x"]  # nothing tied: unchanged


def test_last_stage_holding_only_the_alias_loads_the_canonical_key() -> None:
    last = nn.Module()  # the last stage: the embedding is held by the first stage
    last.head = nn.Linear(4, 8, bias=False)
    install_alias_hooks(last, [("embed.weight", "head.weight")])
    assert list(last.state_dict()) == ["embed.weight"]  # saved under the canonical name
    value = torch.randn(8, 4)
    last.load_state_dict({"embed.weight": value})
    assert torch.equal(last.head.weight, value)


def test_retie_points_an_alias_back_at_the_materialised_weight() -> None:
    with torch.device("meta"):
        root = tied()
    materialize(root.embed, torch.device("cpu"), 1, "embed", library_initializers(root))
    assert root.head.weight.is_meta and not root.embed.weight.is_meta  # one at a time unties them
    retie(root, [("embed.weight", "head.weight")], "head")
    assert root.head.weight is root.embed.weight


def test_materialize_keeps_a_tie_inside_the_materialised_module() -> None:
    with torch.device("meta"):
        root = tied()
    materialize(root, torch.device("cpu"), 1, "", {})
    assert root.head.weight is root.embed.weight and not root.embed.weight.is_meta
    # initialised once, by its first module (the embedding's normal init, not the Linear's uniform one)
    assert root.embed.weight.abs().max() > 1.0


def test_embedding_groups_join_the_pp_ranks_holding_the_first_and_last_stage() -> None:
    grid = torch.arange(12).view(2, 3, 2).tolist()  # (dp 2, pp 3, tp 2)
    # one stage per rank, or round-robin interleaving: the first stage on pp rank 0, the last on pp rank 2
    assert embedding_groups(grid, None) == [[0, 4], [1, 5], [6, 10], [7, 11]]
    assert embedding_groups(grid, (0, 2)) == embedding_groups(grid, None)
    # a CSV action list whose last stage sits on pp rank 1 (e.g. pp 3, two stages per rank, stages 0 and 5 placed
    # on ranks 0 and 1): the group must be pp ranks 0 and 1, not 0 and pp - 1
    assert embedding_groups(grid, (0, 1)) == [[0, 2], [1, 3], [6, 8], [7, 9]]


def test_untie_gives_the_alias_a_copy_and_local_sums_give_both_the_one_weights_gradient() -> None:
    """A V schedule's rank 0 with tp or dp > 1: the embedding (first stage) and the head (last stage) each get their
    own copy; after a backward both copies hold the gradient of the single tied weight, and the norm counts it
    once."""
    from lightning_3d.core.tied import TiedWeights, untie

    reference = tied()
    root = tied()
    root.load_state_dict(reference.state_dict())
    assert untie(root, [("embed.weight", "head.weight"), ("nothing.weight", "other.weight")]) == [
        ("embed.weight", "head.weight")
    ]
    assert root.head.weight is not root.embed.weight and torch.equal(root.head.weight, root.embed.weight)
    with torch.no_grad():
        root.head.weight.zero_()  # a copy initialised by its own module (meta materialisation): made equal below
    pairs = TiedWeights.local(root, [("embed.weight", "head.weight")])
    pairs.broadcast_from_first()
    assert torch.equal(root.head.weight, root.embed.weight)

    tokens = torch.tensor([1, 3, 3, 7])
    reference.head(reference.embed(tokens)).square().sum().backward()
    root.head(root.embed(tokens)).square().sum().backward()
    params = list(root.parameters())
    grads = [p.grad for p in params]
    pairs.sum_grads(params, grads)
    want = reference.embed.weight.grad
    assert torch.allclose(grads[0], want, rtol=1e-6, atol=1e-7) and torch.equal(grads[0], grads[1])
    assert pairs.for_norm(params) == [root.embed.weight]
    # a copy without a gradient (a batch that never reached the head) takes the other's
    grads = [torch.ones(8, 4), None]
    pairs.sum_grads(params, grads)
    assert torch.equal(grads[1], torch.ones(8, 4))


def test_copies_that_disagree_on_requires_grad_are_refused() -> None:
    """Both copies on one rank (a V schedule): unfreezing one module only (BaseFinetuning on the head) would train
    one copy and not the other; the check names the tied weight, and passes once both agree again."""
    from lightning_3d.core.agreed import is_agreed
    from lightning_3d.core.tied import TiedWeights, untie

    root = tied()
    untie(root, [("embed.weight", "head.weight")])
    pairs = TiedWeights.local(root, [("embed.weight", "head.weight")])
    pairs.check_trainable()
    root.head.weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"tied as embed\.weight / head\.weight is trainable on one") as err:
        pairs.check_trainable()
    assert is_agreed(err.value)  # raised by every rank alike: not a fail-fast trigger
    root.embed.weight.requires_grad_(False)
    pairs.check_trainable()


def test_untie_keeps_meta_copies_on_meta() -> None:
    from lightning_3d.core.tied import untie

    with torch.device("meta"):
        root = tied()
    untie(root, [("embed.weight", "head.weight")])
    assert root.head.weight.is_meta and root.head.weight is not root.embed.weight


def test_a_weight_tied_under_four_names_gets_the_sum_of_all_four_gradients_on_every_copy() -> None:
    """An encoder-decoder registers its embedding as the shared one, the encoder's, the decoder's and the head's.
    Untied on a rank that holds both ends (a V schedule with tp or dp > 1), the copies' gradients were summed pair
    by pair with the first, each copy taking the sum as it stood then: only the last copy got the whole gradient,
    and T5 and BART at tp2 x pp2 under dualpipev drifted from one device's after the first step (1e-5)."""
    from lightning_3d.core.tied import TiedWeights, untie

    names = ("shared", "enc", "dec", "head")
    root = nn.ModuleDict({n: nn.Linear(4, 4, bias=False) for n in names})
    for n in names[1:]:
        root[n].weight = root["shared"].weight
    group = tuple(f"{n}.weight" for n in names)
    untie(root, [group])
    assert len({id(root[n].weight) for n in names}) == 4
    pairs = TiedWeights.local(root, [group])
    params = [root[n].weight for n in names]
    grads = [torch.full((4, 4), float(2**k)) for k in range(4)]  # 1 + 2 + 4 + 8
    pairs.sum_grads(params, grads)
    assert all(torch.equal(g, torch.full((4, 4), 15.0)) for g in grads), [g[0, 0].item() for g in grads]
    assert pairs.for_norm(params) == [root["shared"].weight]  # the weight counted once in the norm
