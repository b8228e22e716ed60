"""Llama-family target models, EAGLE draft heads, checkpoint loaders and the tokenizer."""

from polyspec.model.config import ModelConfig
from polyspec.model.eagle import DraftHead
from polyspec.model.llama import CausalLM
from polyspec.model.loader import load_draft, load_target, load_tokenizer
from polyspec.model.tokenizer import Tokenizer

__all__ = [
    "CausalLM",
    "DraftHead",
    "ModelConfig",
    "Tokenizer",
    "load_draft",
    "load_target",
    "load_tokenizer",
]
