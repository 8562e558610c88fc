"""Processes: one file = one process (controller, generator, learner entry, launcher).

Only here: argv/env parsing, sockets from config, process spawning, signal handling.
Library code in ``asyncrl`` never imports this package.
"""
