"""``python -m plate_inspect ...``: the ``plate-inspect`` command line (e.g. under torchrun without --no-python)."""

from plate_inspect.cli.main import main

if __name__ == "__main__":
    main()
