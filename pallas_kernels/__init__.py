"""L7 kernels: ragged paged attention, latent attention (DeepSeek's) and its sparse form (DeepSeek Sparse
Attention's, with its indexer's scores), and the paged KV write, with their references and a backend switch."""

from pallas_kernels.backend import AttentionBackend, attention_backend
from pallas_kernels.kv_write import write_kv, write_kv_reference
from pallas_kernels.kv_write_triton import triton_available, write_kv_triton
from pallas_kernels.latent_attention import latent_paged_attention, latent_paged_attention_reference
from pallas_kernels.paged_decode_mosaic import mosaic_decode_supported, paged_decode_attention_mosaic
from pallas_kernels.ragged_attention_mosaic import ragged_paged_attention_mosaic
from pallas_kernels.ragged_paged_attention import (
    AttentionTuning,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from pallas_kernels.sparse_index import index_scores, index_scores_reference
from pallas_kernels.sparse_latent_attention import sparse_latent_attention, sparse_latent_attention_reference

__all__ = [
    "AttentionBackend",
    "AttentionTuning",
    "attention_backend",
    "index_scores",
    "index_scores_reference",
    "latent_paged_attention",
    "latent_paged_attention_reference",
    "mosaic_decode_supported",
    "paged_decode_attention_mosaic",
    "ragged_paged_attention",
    "ragged_paged_attention_mosaic",
    "ragged_paged_attention_reference",
    "sparse_latent_attention",
    "sparse_latent_attention_reference",
    "triton_available",
    "write_kv",
    "write_kv_reference",
    "write_kv_triton",
]
