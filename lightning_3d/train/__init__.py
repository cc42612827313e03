"""The Hydra application: ``python -m lightning_3d.train`` (``app.py``), its config schemas (``config.py``) and
the callbacks it adds to the Trainer (``callbacks.py``). It uses the library's public API only."""
