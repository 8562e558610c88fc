"""asyncrl: asynchronous reinforcement learning for LLMs with quantized rollouts.

Owns nothing at import time: importing ``asyncrl`` must stay cheap (no torch, no zmq) so that
the CLI, the config schemas and ``protocols`` load in well under a second. Sub-packages pull
their own heavy dependencies when imported.
"""

__version__ = "0.1.0"
