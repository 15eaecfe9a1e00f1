"""An OpenAI-compatible HTTP API in front of tritonserver.

`/v1/models`, `/v1/completions`, `/v1/chat/completions`, `/v1/responses` and `/v1/embeddings` (streamed
as server-sent events or not), served by FastAPI and uvicorn in a process beside tritonserver. Each completion is forwarded to the
Triton model over Triton's gRPC streaming (`tritonclient.grpc.aio`), so instances, batching, metrics
and cancellation stay Triton's: a client that disconnects cancels its Triton request.

- `protocol.py`: the request bodies (pydantic) and how each field maps to the model's inputs and
  sampling parameters;
- `triton.py`: the generate models of the repository, their tokenizers (for chat templates), and
  one streamed Triton request;
- `choices.py`: Triton outputs -> the completion and chat objects' choices, whole or as chunks;
- `responses_api.py`: the Responses API: its requests as chat requests, the chat path's deltas as its
  output items and events, the kept responses;
- `tools.py`: a chat request's tools -> the guide that keeps calls well formed, and the server's chat
  template and tool parser options; `tool_parsers.py`: reading calls out of the model's text, streamed;
- `reasoning.py`: a reasoning model's thinking apart from its answer; `token_bytes.py`: each token's
  own bytes for chat log-probs; `embeddings.py`: `/v1/embeddings`;
- `server.py`: the FastAPI app and `main` (`python -m tritonllm.openai`); `child_process.py`: its start
  as a process of its own, for the launcher.
"""
