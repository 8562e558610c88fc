"""The generation worker process (``python -m workers.generator``): ``process.py`` and its parts."""
