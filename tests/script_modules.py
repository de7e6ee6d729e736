"""Imports a file of scripts/ (not a package) as a module, for the tests of the benchmark and fixture scripts."""

import importlib.util
import os

SCRIPTS = os.path.join(os.path.dirname(__file__), os.pardir, "scripts")


def load_script(name: str):
    """The module of scripts/<name>.py, executed once per call."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
