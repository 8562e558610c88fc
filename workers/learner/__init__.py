"""The learner process (``python -m workers.learner``, one rank): ``process.py`` and its parts."""
