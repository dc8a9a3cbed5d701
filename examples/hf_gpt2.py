"""A Hugging Face GPT2LMHeadModel trained through zerofunc's four lines. No weights are downloaded:
the model is built from a config.

    python examples/hf_gpt2.py                                   # one process
    torchrun --nproc_per_node 2 examples/hf_gpt2.py --stage 3    # two ranks
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

import zerofunc
from train.data import load_tokens, rank_batch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--steps", type=int, default=50)
    a = p.parse_args()
    if not dist.is_initialized() and "RANK" in __import__("os").environ:
        dist.init_process_group("gloo")
    torch.manual_seed(0)  # the same initial weights on every rank
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_head=4, n_embd=128, vocab_size=256, n_positions=128,
                                       bos_token_id=0, eos_token_id=0))
    engine = zerofunc.initialize(model, {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": a.stage},
                                         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    rank, world = engine.comm.rank, engine.comm.world_size
    tokens = load_tokens(None, 128)
    for step in range(1, a.steps + 1):
        x, y, _ = rank_batch(tokens, step, 8, world, rank, 127, seed=0)
        loss = engine(input_ids=torch.cat([x, y[:, -1:]], dim=1), labels=torch.cat([x, y[:, -1:]], dim=1)).loss
        engine.backward(loss)
        engine.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
