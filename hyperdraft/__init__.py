"""hyperdraft: an LLM inference engine built around fast, lossless speculative decoding."""

from hyperdraft.llm import LLM, GenerateOutput, StreamDelta
from hyperdraft.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "GenerateOutput", "StreamDelta"]
__version__ = "0.1.0"
