import pytest
import torch
from torch import nn

from lightning_tfdebug.core.groups import build_param_groups, default_group_of, tied_groups
from lightning_tfdebug.demo import TinyGPT


def test_tiny_gpt_groups_follow_its_blocks():
    groups = build_param_groups(TinyGPT(d_model=16, n_layers=3, n_heads=2))
    assert groups.group_names == ("embeddings", "blocks.0", "blocks.1", "blocks.2", "other", "head")
    assert groups.members("head") == ["head.weight"]
    assert groups.members("other") == ["ln_f.weight", "ln_f.bias"]
    assert "blocks.1.mlp.fc.weight" in groups.members("blocks.1")


def test_hugging_face_gpt2_groups_without_a_download():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    group_of = default_group_of(model)
    assert group_of["transformer.wte.weight"] == "embeddings"
    assert group_of["transformer.h.1.attn.c_attn.weight"] == "transformer.h.1"
    assert group_of["transformer.ln_f.weight"] == "other"
    assert tied_groups(model, build_param_groups(model)) == ("embeddings",)  # wte is the LM head too
    tiny = TinyGPT(d_model=16, n_layers=1, n_heads=2)  # an untied head
    assert tied_groups(tiny, build_param_groups(tiny)) == ()


def test_frozen_parameters_are_left_out_and_regex_groups_win():
    model = TinyGPT(d_model=16, n_layers=1, n_heads=2)
    model.tok_emb.requires_grad_(False)
    groups = build_param_groups(model, groups={"attn": r"\.attn\.", "norms": r"ln"})
    assert "tok_emb.weight" not in groups.names
    assert set(groups.group_names) == {"attn", "norms", "other"}


def test_a_model_without_module_lists_uses_head_and_other():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 10))
    group_of = default_group_of(model)
    assert group_of == {
        "0.weight": "embeddings",
        "1.weight": "other",
        "1.bias": "other",
        "2.weight": "head",
        "2.bias": "head",
    }
    assert torch.is_tensor(next(model.parameters()))
