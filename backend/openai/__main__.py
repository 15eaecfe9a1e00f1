"""`python -m tritonllm.openai`: the OpenAI-compatible server (server.py)."""

from tritonllm.openai.server import main

if __name__ == "__main__":
    main()
