"""Single-process tests of the example modules (``examples/``, imported as ``lightning_3d_examples``).

These modules are what users copy and what the strategy's multi-process tests train, so the tests pin
the contract they follow (one ``body`` Sequential, meta-device construction, tensor-parallel-friendly
attention) as well as plain single-device training. Whole file: a few seconds on one CPU thread.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import RandomSampler, SequentialSampler

from lightning_3d_examples import (
    GPT,
    PRESETS,
    BlobsDataModule,
    ByteTextDataModule,
    GPTConfig,
    MLPClassifier,
    decode,
    encode,
    generate,
)
from lightning_3d_examples.gpt import CausalSelfAttention, Embedding, Head
from lightning_3d_examples.text_data import read_corpus, stdlib_sources

pytestmark = pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning")


def _trainer(**kwargs) -> L.Trainer:
    args = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    args.update(kwargs)
    return L.Trainer(**args)


def _built(preset: str = "tiny", **kwargs) -> GPT:
    model = GPT(preset, **kwargs)
    model.configure_model()
    return model


def _reset_children_first(module: nn.Module) -> None:
    # Reversed pre-order: every module comes after all of its descendants.
    for m in reversed(list(module.modules())):
        if callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()


# --------------------------------------------------------------------------------------------- GPT structure


def test_gpt_forward_shapes():
    torch.manual_seed(0)
    model = _built("tiny")
    cfg = model.config
    for T in (1, 7, cfg.block_size):
        x = torch.randint(0, cfg.vocab_size, (3, T))
        assert model(x).shape == (3, T, cfg.vocab_size)
    x = torch.randint(0, cfg.vocab_size, (2, 5))
    logits = model.predict_step((x, x), 0)
    torch.testing.assert_close(logits, model(x))
    torch.testing.assert_close(model.predict_step(x, 0), logits)


def test_configure_model_is_idempotent():
    model = _built("tiny")
    body = model.body
    params = dict(model.named_parameters())
    model.configure_model()
    assert model.body is body
    assert all(p is params[n] for n, p in model.named_parameters())


def test_body_is_the_whole_model():
    model = _built("tiny", n_layer=3)
    assert isinstance(model.body, nn.Sequential)
    assert len(model.body) == 3 + 2
    assert isinstance(model.body[0], Embedding) and isinstance(model.body[-1], Head)
    assert all(name.startswith("body.") for name, _ in model.named_parameters())
    assert list(model.buffers()) == []  # nothing to materialise or shard but parameters
    # No weight tying: embedding and head end up on different pipeline stages.
    assert model.body[0].wte.weight.data_ptr() != model.body[-1].lm_head.weight.data_ptr()
    # Before configure_model there are no layers at all (the strategy builds them on the meta device).
    assert list(GPT("tiny").parameters()) == []


def test_config_overrides_and_errors():
    model = GPT("tiny", n_layer=5, dropout=0.1)
    assert model.config == GPTConfig(**{**vars(PRESETS["tiny"]), "n_layer": 5, "dropout": 0.1})
    assert PRESETS["tiny"].n_layer == 2  # the preset itself is untouched
    # Hyperparameters hold the overrides, so load_from_checkpoint can rebuild the same model.
    assert GPT(**model.hparams).config == model.config
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        GPT("huge")
    with pytest.raises(TypeError, match="n_layers"):
        GPT("tiny", n_layers=3)
    with pytest.raises(ValueError, match="n_embd=30 is not divisible by n_head=4"):
        GPT("tiny", n_embd=30)


def _assert_gpt2_init(model: GPT) -> None:
    block, resid_std = model.body[1], 0.02 / math.sqrt(2 * model.config.n_layer)
    expected = {
        model.body[0].wte.weight: 0.02,
        model.body[0].wpe.weight: 0.02,
        block.attn.q_proj.weight: 0.02,
        block.attn.v_proj.weight: 0.02,
        block.mlp.fc.weight: 0.02,
        block.attn.out_proj.weight: resid_std,
        block.mlp.proj.weight: resid_std,
        model.body[-1].lm_head.weight: 0.02,
    }
    for p, std in expected.items():
        assert p.std().item() == pytest.approx(std, rel=0.1)
        assert abs(p.mean().item()) < std / 10
    assert torch.all(block.attn.q_proj.bias == 0) and torch.all(block.mlp.proj.bias == 0)
    assert torch.all(block.ln_1.weight == 1) and torch.all(block.ln_1.bias == 0)
    # Small logits at init: the loss starts at about ln(256) (default nn.Linear init gives ~5.7).
    x = torch.randint(0, 256, (4, 32))
    with torch.no_grad():
        loss = F.cross_entropy(model(x).reshape(-1, 256), x.reshape(-1)).item()
    assert loss == pytest.approx(math.log(256), abs=0.1)


def test_meta_construction_then_materialisation():
    with torch.device("meta"):
        model = _built("small")
    assert all(p.is_meta for p in model.parameters())

    torch.manual_seed(0)
    model.to_empty(device="cpu")
    _reset_children_first(model)
    assert all(torch.isfinite(p).all() for p in model.parameters())

    # Every module owning parameters directly can re-initialise them (else the strategy leaves garbage).
    for m in model.modules():
        if list(m.parameters(recurse=False)):
            assert callable(getattr(m, "reset_parameters", None)), type(m).__name__

    _assert_gpt2_init(model)
    torch.manual_seed(1)
    _assert_gpt2_init(_built("small"))  # eager construction initialises the same way


def test_largest_preset_only_on_meta():
    with torch.device("meta"):
        model = _built("xl")
        logits = model(torch.zeros(2, 16, dtype=torch.long))
    assert logits.shape == (2, 16, 256) and logits.is_meta
    n = sum(p.numel() for p in model.parameters())
    assert 1.1e9 < n < 1.3e9
    assert PRESETS["1b"] is PRESETS["xl"]


def test_attention_splits_by_heads_like_tensor_parallel():
    """Column-split q/k/v and row-split out_proj into two halves of the heads; the partial sums add up.

    This is what ColwiseParallel/RowwiseParallel do; it only works because forward reshapes with
    ``head_dim`` (``-1`` heads), not with the global head count.
    """
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=16, n_layer=2, n_head=4, n_embd=32)
    attn = CausalSelfAttention(cfg)
    x = torch.randn(2, 10, cfg.n_embd)
    half = cfg.n_embd // 2
    out = attn.out_proj.bias.clone()
    for r in range(2):
        rows = slice(r * half, (r + 1) * half)
        shard = CausalSelfAttention(cfg)
        for name in ("q_proj", "k_proj", "v_proj"):
            full = getattr(attn, name)
            lin = nn.Linear(cfg.n_embd, half)
            lin.weight.data, lin.bias.data = full.weight[rows].clone(), full.bias[rows].clone()
            setattr(shard, name, lin)
        shard.out_proj = nn.Linear(half, cfg.n_embd, bias=False)
        shard.out_proj.weight.data = attn.out_proj.weight[:, rows].clone()
        out = out + shard(x)
    torch.testing.assert_close(out, attn(x), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------- GPT training


def test_configure_optimizers_groups_and_schedule():
    model = _built("tiny", lr=1e-3, weight_decay=0.1, warmup_steps=10, max_steps=100, min_lr_ratio=0.1)
    conf = model.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    assert conf["lr_scheduler"]["interval"] == "step"
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    fn = sched.lr_lambdas[0]
    assert fn(0) == pytest.approx(1 / 11)
    assert fn(10) == pytest.approx(1.0)
    assert fn(55) == pytest.approx(0.55)  # halfway down the cosine: (1 + 0.1) / 2
    assert fn(100) == pytest.approx(0.1) and fn(1000) == pytest.approx(0.1)
    # Without max_steps: a constant learning rate and no scheduler.
    assert isinstance(_built("tiny").configure_optimizers(), torch.optim.AdamW)


def _mean_val_loss(model: GPT, dm: ByteTextDataModule, batches: int = 4) -> float:
    model.eval()
    losses = []
    with torch.no_grad():
        for i, (x, y) in enumerate(dm.val_dataloader()):
            if i == batches:
                break
            losses.append(F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)).item())
    model.train()
    return sum(losses) / len(losses)


def test_tiny_gpt_learns_bytes(tmp_path):
    L.seed_everything(0, verbose=False)
    dm = ByteTextDataModule(block_size=32, batch_size=16, max_bytes=200_000)
    dm.setup()
    model = _built("tiny", lr=1e-2, warmup_steps=3, max_steps=30)
    before = _mean_val_loss(model, dm)
    trainer = _trainer(max_steps=30, limit_val_batches=4)
    trainer.fit(model, dm)
    after = _mean_val_loss(model, dm)
    # Measured: 5.58 -> 2.88 (seeds 0-3: drops of 2.55 to 2.82).
    assert before == pytest.approx(math.log(256), abs=0.1)
    assert before - after > 2.0, (before, after)
    assert "train_loss" in trainer.callback_metrics
    # What validation_step logs is the same mean loss.
    assert trainer.validate(model, dm, verbose=False)[0]["val_loss"] == pytest.approx(after, rel=1e-5)

    # A checkpoint rebuilds the same model from the saved hyperparameters (configure_model included).
    trainer.save_checkpoint(tmp_path / "gpt.ckpt")
    loaded = GPT.load_from_checkpoint(tmp_path / "gpt.ckpt")
    x = dm.val_set[0][0][None]
    model.eval()
    torch.testing.assert_close(loaded.eval()(x), model(x))


def test_generate_shape_and_determinism():
    torch.manual_seed(0)
    model = _built("tiny")
    prompt = encode("def ")
    out = generate(model, prompt, max_new_tokens=40, generator=torch.Generator().manual_seed(7))
    assert out.shape == (len(prompt) + 40,) and torch.equal(out[: len(prompt)], prompt)
    again = generate(model, prompt, max_new_tokens=40, generator=torch.Generator().manual_seed(7))
    assert torch.equal(out, again)
    other = generate(model, prompt, max_new_tokens=40, generator=torch.Generator().manual_seed(8))
    assert not torch.equal(out, other)
    torch.manual_seed(3)
    a = generate(model, prompt[None].repeat(2, 1), max_new_tokens=5, top_k=10)
    torch.manual_seed(3)
    b = generate(model, prompt[None].repeat(2, 1), max_new_tokens=5, top_k=10)
    assert a.shape == (2, len(prompt) + 5) and torch.equal(a, b)
    # Greedy decoding equals top_k=1 sampling, and the context is cropped beyond block_size.
    long_prompt = torch.randint(0, 256, (1, model.config.block_size + 5))
    greedy = generate(model, long_prompt, max_new_tokens=3, temperature=0)
    assert torch.equal(greedy, generate(model, long_prompt, max_new_tokens=3, top_k=1))
    assert model.training  # mode restored
    assert isinstance(decode(out), str)


# --------------------------------------------------------------------------------------------- MLP on blobs


def test_blobs_are_deterministic_and_split():
    a, b, c = BlobsDataModule(seed=0), BlobsDataModule(seed=0), BlobsDataModule(seed=1)
    for dm in (a, b, c):
        dm.setup()
    assert torch.equal(a.train_set.tensors[0], b.train_set.tensors[0])
    assert not torch.equal(a.train_set.tensors[0], c.train_set.tensors[0])
    sizes = [len(s) for s in (a.train_set, a.val_set, a.test_set)]
    assert sum(sizes) == 2048 and sizes[1] == sizes[2] == 204
    counts = torch.bincount(a.train_set.tensors[1], minlength=4)
    assert counts.min() > 0.2 * sizes[0]  # roughly balanced
    assert not a.train_dataloader().drop_last


def test_mlp_learns_blobs():
    L.seed_everything(0, verbose=False)
    dm = BlobsDataModule()
    model = MLPClassifier(depth=2)
    model.configure_model()
    assert [type(m) for m in model.body] == [nn.Linear, nn.ReLU, nn.Linear, nn.ReLU, nn.Linear]
    trainer = _trainer(max_epochs=3)
    chance = trainer.validate(model, dm, verbose=False)[0]["val_acc"]
    trainer.fit(model, dm)
    assert {"train_loss", "val_loss", "val_acc"} <= set(trainer.callback_metrics)
    acc = trainer.validate(model, dm, verbose=False)[0]["val_acc"]
    # Measured: 0.98 after 3 epochs (about 0.2 s).
    assert chance < 0.6 and acc > 0.9, (chance, acc)
    preds = trainer.predict(model, dm)
    assert preds[0].shape == (64, 4)


# --------------------------------------------------------------------------------------------- byte text data


def test_stdlib_corpus_found_and_windows_cover_it():
    files = stdlib_sources()
    assert len(files) > 100
    assert not any("site-packages" in f.parts for f in files)
    dm = ByteTextDataModule(block_size=64, max_bytes=300_000, val_fraction=0.1)
    dm.setup()
    corpus = torch.frombuffer(bytearray(read_corpus(None, 300_000)), dtype=torch.uint8).long()
    assert len(corpus) == 300_000
    n = dm.block_size + 1
    n_train, n_val = len(dm.train_set), len(dm.val_set)
    assert n_train + n_val == len(corpus) // n
    assert n_val == round(0.1 * (len(corpus) // n))

    x, y = dm.train_set[3]
    assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (64,)
    assert torch.equal(x[1:], y[:-1])
    # Windows are contiguous and non-overlapping; validation is the tail of the corpus.
    rebuilt = torch.cat([torch.cat([x, y[-1:]]) for x, y in (dm.train_set[i] for i in range(n_train))])
    assert torch.equal(rebuilt, corpus[: n_train * n])
    assert torch.equal(dm.val_set[0][0], corpus[n_train * n : n_train * n + 64])
    assert isinstance(dm.train_dataloader().sampler, RandomSampler)
    assert isinstance(dm.val_dataloader().sampler, SequentialSampler)

    train_set = dm.train_set
    dm.setup("validate")  # cheap on every call: nothing is re-read
    assert dm.train_set is train_set


def test_encode_decode():
    s = "def f(x):\n    return x + 1  # ok\n"
    assert decode(encode(s)) == s
    assert encode("A").tolist() == [65] and encode(s).dtype == torch.long
    assert decode(encode("héllo")) == "héllo"  # UTF-8 round trip
    assert decode([0xFF, 65]) == "\ufffdA"  # invalid bytes are replaced, not raised
    assert ByteTextDataModule.decode(ByteTextDataModule.encode("x")) == "x"


def test_text_file_path(tmp_path):
    text = "".join(f"line {i}: the quick brown fox\n" for i in range(200))
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    dm = ByteTextDataModule(path=str(path), block_size=16, batch_size=4, val_fraction=0.25)
    dm.setup()
    n_windows = len(text) // 17
    assert len(dm.train_set) + len(dm.val_set) == n_windows
    x, _ = next(iter(dm.val_dataloader()))
    assert x.shape == (4, 16)
    first = len(dm.train_set) * 17
    assert decode(x[0]) == text[first : first + 16]

    tiny = tmp_path / "tiny.txt"
    tiny.write_text("too short")
    with pytest.raises(ValueError, match="too few"):
        ByteTextDataModule(path=str(tiny), block_size=16).setup()
