"""Batch jobs: the asynchronous tier, in each SDK's own API (OpenAI `/v1/files` + `/v1/batches`, Anthropic
`/v1/messages/batches`). Not the fixed-batch `/v1/batch-generate` (gateway/batch_api.py).

A job's items are stored durably (store.py: Redis, else SQLite) and run by the runner (runner.py) as ordinary
requests through the gateway's own app (dispatch.py), as the job's tenant in the batch priority class: the same
validation, admission, quotas, router queueing and engine as a synchronous call, each item's answer (status and
body) kept as it would have been returned. A result is written once per (job, item index); whatever has none
after a restart runs again.
"""
