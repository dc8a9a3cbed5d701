"""A Hugging Face GPT2LMHeadModel (tied head, its own ModuleList of blocks) trains through zerofunc.initialize
exactly like one device. Runs where transformers is installed (the test extras install it)."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.bare import in_world, rel_err

transformers = pytest.importorskip("transformers")


def hf_four_lines(stage: int):
    import zerofunc
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_head=3, n_embd=27, vocab_size=53, n_positions=32, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1,
                            foreach=False)
    engine = zerofunc.initialize(model, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
                                         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95],
                                                                                   "eps": 1e-5, "weight_decay": 0.1}}})
    rank, world = engine.comm.rank, engine.comm.world_size
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 53, (2 * world, 11), generator=gen)
        loss = engine(input_ids=ids[2 * rank:2 * rank + 2], labels=ids[2 * rank:2 * rank + 2]).loss
        engine.backward(loss)
        engine.step()
        reference(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    params = engine.full_parameters()
    units = [u.name for u in engine.units]
    return units, max(rel_err(params[n], p.detach()) for n, p in reference.named_parameters())


@pytest.mark.parametrize("stage", [0, 3])
def test_hugging_face_gpt2_trains_like_one_device(stage):
    for units, err in in_world(2, hf_four_lines, stage):
        assert units == ["", "transformer.h.0", "transformer.h.1"]
        assert err <= 1e-5
