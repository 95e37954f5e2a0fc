"""Model checkpoints: random-weight Hugging Face checkpoints for tests, GGUF files converted to Hugging Face
checkpoints, and the trained models Flotilla knows by name (the catalog, fetched once at set-up)."""

from flotilla.models.checkpoint import ARCHITECTURES, SIZES, ModelShape, write_checkpoint

__all__ = ["ARCHITECTURES", "SIZES", "ModelShape", "write_checkpoint"]
