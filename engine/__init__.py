"""Sluice's inference engine: paged KV cache, continuous batching, chunked prefill, preemption."""

from engine.outputs import ChoiceOutput, CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured_outputs import StructuredOutputs

__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "RequestOutput", "CompletionOutput", "ChoiceOutput"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers: import it lazily so the pure-Python parts stay light.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(name)
