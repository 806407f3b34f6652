"""Models: GPT (GPT-2/3 style, with RMSNorm, rotary and SwiGLU as options), tensor-parallel and
splittable into pipeline chunks, with Hugging Face GPT-2 and Llama import and export."""

from megart.models.config import GPTConfig
from megart.models.gpt import GPT, GPTChunk, pipeline_chunks
from megart.models.stages import chunk_layers

__all__ = ["GPTConfig", "GPT", "GPTChunk", "chunk_layers", "pipeline_chunks"]
