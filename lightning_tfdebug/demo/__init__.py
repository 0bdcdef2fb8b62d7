"""The tiny transformer, tokenizer and generated corpus used by the examples, tests and benchmarks."""

from lightning_tfdebug.demo.data import IGNORE_INDEX, ByteTokenizer, TinyTextDataModule, generate_corpus
from lightning_tfdebug.demo.model import TinyGPT

__all__ = ["IGNORE_INDEX", "ByteTokenizer", "TinyGPT", "TinyTextDataModule", "generate_corpus"]
