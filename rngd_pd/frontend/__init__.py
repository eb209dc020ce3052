"""OpenAI-compatible HTTP front end over Triton's gRPC stream (see docs/frontend.md).

`rngd_pd.frontend.app.create_app(FrontendConfig(...))` builds the ASGI app and
`rngd_pd.frontend.app.run(config)` serves it; nothing heavy is imported here.
"""
