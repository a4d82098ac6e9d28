"""Pallas attention kernels for chunked KV-cache streaming.

The KV cache is streamed from host tiers through a fixed-size device staging
buffer one chunk at a time. ``chunk_attention`` attends a query block over one
chunk and returns a chunk-normalized output plus its log-sum-exp, and
``merge_partials`` folds the per-chunk results together (online softmax).

``chunk_attention_reference`` is the plain-jnp oracle; ``chunk_attention_tpu``
(Mosaic) and ``chunk_attention_gpu`` (Triton) are the kernels behind
``chunk_attention``.
"""

from ._common import BLOCK_KV_TABLE
from ._common import DEFAULT_BLOCK_KV
from ._common import default_block_kv
from ._common import static_validate_inputs
from .chunk_attention import chunk_attention
from .chunk_attention import resolve_backend
from .chunk_attention_gpu import chunk_attention_gpu
from .chunk_attention_tpu import chunk_attention_tpu
from .reference import attention_reference
from .reference import chunk_attention_reference
from .reference import merge_many
from .reference import merge_partials

__all__ = [
    "BLOCK_KV_TABLE",
    "DEFAULT_BLOCK_KV",
    "attention_reference",
    "chunk_attention",
    "chunk_attention_gpu",
    "chunk_attention_reference",
    "chunk_attention_tpu",
    "default_block_kv",
    "merge_many",
    "merge_partials",
    "resolve_backend",
    "static_validate_inputs",
]
