"""The experiment harness: train, bench, sweep, demo and the model zoo the CLI runs.

Sits above the library: nothing under `lms` but the CLI and the package root imports it.
"""
