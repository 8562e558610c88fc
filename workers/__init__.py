"""Processes: one file or package = one process (controller, generator/, learner/ (the torchrun entry), launcher).

Only here: argv/env parsing, sockets from config, process spawning, signal handling.
Library code in ``asyncrl`` never imports this package.
"""
