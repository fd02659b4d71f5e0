"""Arguments and helpers shared by the ``pasa`` subcommands (no heavy imports at module level)."""
from __future__ import annotations

import argparse

__all__ = ["add_generation_args", "model_dtype"]


def add_generation_args(p: argparse.ArgumentParser, out: str, frames: int = 4, steps: int = 4, size: int = 64) -> None:
    p.add_argument("--model", default="tiny",
                   help="'tiny' (embedded random SVD), 'tiny-resonant', a hub id or a save_pretrained folder")
    p.add_argument("--image", default="builtin:rocket",
                   help="conditioning image: a file or builtin:astronaut|coffee|rocket")
    p.add_argument("--frames", type=int, default=frames)
    p.add_argument("--steps", type=int, default=steps, help="denoising steps")
    p.add_argument("--height", type=int, default=size)
    p.add_argument("--width", type=int, default=size)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default=None,
                   help="model dtype (default fp16 on CUDA, fp32 on CPU where attention is still cast to fp16)")
    p.add_argument("--local-files-only", action="store_true", help="never contact the Hugging Face hub")
    p.add_argument("--out", default=out, help="output folder")


def model_dtype(device: str, name: str | None):
    import torch

    if name is None:
        return torch.float16 if torch.device(device).type == "cuda" else torch.float32
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[name]
