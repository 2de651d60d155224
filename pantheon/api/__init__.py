"""The HTTP surface: the app factory, middleware, auth, metrics, and the OpenAI and admin routes."""
