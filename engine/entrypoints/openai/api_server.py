"""`python -m engine.entrypoints.openai.api_server --model M ...`: vLLM's module path for its OpenAI-compatible
server, so commands written for vLLM run unchanged; the same program as `pagedesk-serve`
(engine/entrypoints/serve.py)."""
import sys

from engine.entrypoints.serve import main

if __name__ == "__main__":
    sys.exit(main())
