"""Sluice's inference engine: paged KV cache, continuous batching, chunked prefill, preemption."""

import os

# The native step's threads meet at OpenMP barriers many times a token. libgomp's default lets a thread spin
# 300,000 pauses at one (up to ~14 ms where a pause is ~140 cycles, as on Intel since Skylake) before it sleeps:
# when another process takes a core, the thread that is needed waits for a core that the spinning one holds, and a
# 2-core machine with one busy neighbour decoded at 1-3 tok/s instead of ~100. 1,000 spins keep a quiet machine's
# speed (measured level) and give the core up at once otherwise. Read when torch loads libgomp: set before that,
# and only if the user chose neither.
if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "1000"

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
