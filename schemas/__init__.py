"""The wire contract of npu-pool: messages, codec, Redis key names and settings."""

from schemas.config import Settings
from schemas.keys import GROUP, Keys
from schemas.messages import (
    Completion,
    ErrorInfo,
    FinishReason,
    GenerateRequest,
    ResultChunk,
    SamplingParams,
    Usage,
)

__all__ = [
    "GROUP",
    "Completion",
    "ErrorInfo",
    "FinishReason",
    "GenerateRequest",
    "Keys",
    "ResultChunk",
    "SamplingParams",
    "Settings",
    "Usage",
]
