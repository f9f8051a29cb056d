"""epd: disaggregated Encode / Prefill / Decode serving for multimodal LLMs."""

from epd.outputs import CompletionOutput, RequestOutput
from epd.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy so that `import epd.kernels` etc. stay light.
    if name == "LLM":
        from epd.llm import LLM

        return LLM
    raise AttributeError(name)
