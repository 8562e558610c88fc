"""What the benchmark scripts share: the code more than one script under ``scripts/`` (or a test) uses.

Owns: ``report`` (options, table, JSON), ``measure`` (interleaved ratios, intervals), ``runs`` (``asyncrl
train`` as a subprocess, a process tree's memory), ``models`` and ``weightsync`` (the weight-sync benchmarks'
parts). It sits at the top: ``scripts -> asyncrl.bench -> workers -> asyncrl -> protocols``.
Never: is imported by the rest of ``asyncrl`` or by ``workers`` (``tests/unit/test_layout.py`` checks it), or
imports a script; ``report`` is the one module under ``asyncrl/`` that parses a command line.
"""
