"""The service layer: every request of every front, between the fronts (sdxl_engine/serving) and the engine.

request.py (the one request type, :func:`to_request`), image_prep.py (images a client sends, made ready for the
engine: A1111's resize modes, masks, the paste-back), jobs.py (a request's life by id: events, stop flags, result),
service.py (admission, the line in front of the engine, the workers), delivery.py and images.py (PNG bytes with
A1111's parameters, the info record, saved copies), styles.py (the presets). No Gradio and no HTTP here.
"""
