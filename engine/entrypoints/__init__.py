"""How the engine is reached: the pagedesk-serve CLI, the offline LLM, the async engine, the OpenAI server and the router."""
