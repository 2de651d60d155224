"""The OpenAI-compatible API: request validation and response objects (``protocol``), the chat service (``service``)."""
