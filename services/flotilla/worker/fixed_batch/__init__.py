"""The fixed-batch backend of `flotilla worker --backend fixed-batch`: an accelerator behind a call that cannot
change, `run_batch(inputs: list[str]) -> list[str]` (1 to B inputs, one output each in order, one call at a time).

contract.py loads and checks a run_batch by import path; simulated.py and engine_batch.py are the two shipped;
service.py serves it over gRPC (FixedBatchService.RunBatch); server.py wires it and registers with the router
through the worker's RouterLinks. The router batches calls onto it (router/batch_dispatcher.py)."""
