"""The batch-job routes of both dialects."""

from __future__ import annotations

from fastapi import FastAPI

from flotilla.gateway.batch_jobs import anthropic_batches, openai_batches, openai_files


def add_routes(app: FastAPI) -> None:
    route = app.add_api_route
    route("/v1/files", openai_files.upload_file, methods=["POST"])
    route("/v1/files", openai_files.list_files, methods=["GET"])
    route("/v1/files/{file_id}", openai_files.get_file, methods=["GET"])
    route("/v1/files/{file_id}", openai_files.delete_file, methods=["DELETE"])
    route("/v1/files/{file_id}/content", openai_files.file_content, methods=["GET"])
    route("/v1/batches", openai_batches.create_batch, methods=["POST"])
    route("/v1/batches", openai_batches.list_batches, methods=["GET"])
    route("/v1/batches/{batch_id}", openai_batches.get_batch, methods=["GET"])
    route("/v1/batches/{batch_id}/cancel", openai_batches.cancel_batch, methods=["POST"])
    route("/v1/messages/batches", anthropic_batches.create_batch, methods=["POST"])
    route("/v1/messages/batches", anthropic_batches.list_batches, methods=["GET"])
    route("/v1/messages/batches/{batch_id}", anthropic_batches.get_batch, methods=["GET"])
    route("/v1/messages/batches/{batch_id}/cancel", anthropic_batches.cancel_batch, methods=["POST"])
    route("/v1/messages/batches/{batch_id}/results", anthropic_batches.batch_results, methods=["GET"])
