"""Serving the engine: the HTTP server around the page (server.py), the command line (cli.py),
the browser history (history.py), and scale-out on Ray Serve (scaleout.py: settings without Ray;
replicas.py: the engine deployment and the front's stand-in, imported only with --replicas;
deploy/kuberay/: RayService manifests). Nothing here imports Gradio: app.py builds the page and
hands it over."""
