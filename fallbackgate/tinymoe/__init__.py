"""A tiny trained Qwen3-MoE checkpoint bundled with fallbackgate.

The checkpoint directory loads offline with
``transformers.AutoModelForCausalLM.from_pretrained(CHECKPOINT_DIR)``.
"""

import pathlib

CHECKPOINT_DIR = pathlib.Path(__file__).parent / "checkpoint"

__all__ = ["CHECKPOINT_DIR"]
