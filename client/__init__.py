"""tritonllm_client: a tritonclient gRPC streaming client for the tritonllm models.

Modules: `stream` (one streaming request, its timings and a reusable connection pool),
`workload` (YAML scenarios and deterministic prompts), `bench` (open-loop replay benchmark),
`report` (statistics, table, plots), `cli` (the `tritonllm-client` command). Kept import-light on
purpose: Locust's gevent setup must run before tritonclient/grpc create any channel.
"""
