"""The OpenAI-compatible HTTP server (`exl2 serve`): `exl2.server.app.create_app(engine, config)`."""
