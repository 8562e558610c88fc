"""Configuration: structured schemas (schema.py), the Hydra loader (loader.py), the settings of the role commands
(roles.py), the device grammar (devices.py) and the algorithm's options (algo.py), each imported from its module.
Imports no torch or zmq, and nothing of asyncrl but ``asyncrl.constants`` (tests/unit/test_layers.py); this
package exports nothing, so ``asyncrl.algo`` imports its options without the schema (and msgspec)."""
