"""Worker: one model version's engine behind WorkerService, registered with the router."""
