"""nanoserve: a compact LLM inference and serving engine.

Offline use::

    from nanoserve import LLM, SamplingParams
    llm = LLM("smollm2-135m")
    print(llm.generate("The capital of France is", SamplingParams(temperature=0))[0].outputs[0].text)
"""

from importlib.metadata import PackageNotFoundError, version

from nanoserve.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from nanoserve.sampling_params import SamplingParams, StructuredOutputs

try:
    __version__ = version("nanoserve")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name):
    # Importing the engine pulls in torch and transformers; do it only when LLM is used.
    if name == "LLM":
        from nanoserve.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutputs", "TokenLogprobs"]
