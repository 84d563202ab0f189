"""Tensors live here: models, checkpoint loading, paged KV pools, attention, sampling, proposers, steps."""
