"""kvxfer: a KV-cache transfer sidecar for disaggregated LLM serving.

Importing this package must stay cheap and must never import vLLM or torch;
only ``kvxfer.connector`` imports vLLM and only the CUDA path imports torch.
"""

__version__ = "0.1.0"
