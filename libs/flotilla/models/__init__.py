"""Model checkpoints: random-weight Hugging Face checkpoints for tests and local runs."""

from flotilla.models.checkpoint import ARCHITECTURES, SIZES, ModelShape, write_checkpoint

__all__ = ["ARCHITECTURES", "SIZES", "ModelShape", "write_checkpoint"]
