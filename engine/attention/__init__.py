"""Attention backends over the paged KV cache: the torch reference (CPU and CUDA) and FlashInfer (CUDA)."""
