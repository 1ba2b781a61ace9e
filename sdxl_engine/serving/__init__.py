"""Serving the engine: the HTTP server around the page (server.py), the command line (cli.py),
the browser history (history.py). Nothing here imports Gradio: app.py builds the page and hands
it over."""
