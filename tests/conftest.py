"""Suite-wide settings. One torch thread per process: the suite runs several processes at once (workers,
router, gateway, transformers as the reference) on a 2-core machine, where OpenMP threads that spin
while waiting for a busy core make every process several times slower."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the service processes the tests start
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Shared checkpoint fixtures: `tiny_checkpoint` (one tiny llama, seed 0, read-only) and `checkpoint_factory`.
from tests.support.checkpoints import checkpoint_factory, tiny_checkpoint  # noqa: E402,F401
# The trained default model (SmolLM2-135M-Instruct), converted once, and transformers' greedy answers on it.
from tests.support.trained_model import trained_checkpoint, trained_reference  # noqa: E402,F401
from tests.support.redis_server import redis_server, redis_server_factory, redis_url  # noqa: E402,F401  (real Redis)
