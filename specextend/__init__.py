"""SpecExtend: lossless speculative decoding for long inputs (efficient attention + Cross-model Retrieval).

The engine: token ids in, events out. See engine.generate.
"""

from .config import AttentionConfig, DraftConfig, GenerationConfig, RetrievalConfig, preset

__all__ = ["AttentionConfig", "DraftConfig", "GenerationConfig", "RetrievalConfig", "preset"]
