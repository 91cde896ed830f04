"""Command-line interface (installed as ``plate_inspect.cli``): a thin layer over the Python API."""
