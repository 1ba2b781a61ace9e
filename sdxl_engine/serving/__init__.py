"""Serving the engine: the page's events, clients of the service (handler.py: submit, follow, the gallery's files,
history.py's record), the process's main (main.py), the HTTP server around the page (server.py, guard.py; who a
client is: admission.py), the command line (cli.py), every use of Gradio's internals (gradio_internals.py),
the page's texts, CSS and scripts (page_assets.py), and scale-out on Ray Serve (scaleout.py:
settings without Ray; replicas.py: the engine deployment and the front's stand-in, imported only
with --replicas; deploy/kuberay/: RayService manifests). app.py builds the page and hands its
builder to main.run. Of these, only handler.py imports Gradio at its own import (main.py imports it
after the pre-Gradio check; gradio_internals.py imports Gradio's classes where it uses them), and
nothing here imports app.py."""
