"""`tritonllm-serve`'s supervision of tritonserver: the supervisor (supervisor.py) and the front on the
public ports (front.py); docs/OPERATIONS.md describes what they promise."""
