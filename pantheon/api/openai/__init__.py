"""The OpenAI-compatible API: request validation and response objects (``protocol``) and the routes
(chat, completions, Responses, embeddings, tokenize); the generation and embedding machinery they
share with Ollama's routes is ``pantheon.api.generation`` and ``pantheon.api.embedding``."""
