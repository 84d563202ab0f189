"""Typed errors raised by the engine; the CLI and the server turn them into one-line messages."""

from __future__ import annotations


class SpecstepError(Exception):
    """Base class: every error the user can cause derives from this."""


class CheckpointError(SpecstepError):
    """A model folder is missing, malformed, of an unsupported architecture, or has missing/mismatched tensors."""


class InvalidRequestError(SpecstepError):
    """A request's prompt or parameters are out of range."""


class OutOfPagesError(SpecstepError):
    """The KV page pool cannot hold what was asked of it."""


class ConfigError(SpecstepError):
    """An engine option cannot be honoured on this machine (e.g. FlashInfer without CUDA)."""


class ParallelError(ConfigError):
    """A tensor-parallel group cannot be formed (a rank did not join in time, a backend is missing) or the model
    cannot be split over it (heads, KV heads or the MLP width not divisible by the group size)."""
