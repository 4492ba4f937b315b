"""``python -m keel`` runs the command-line interface."""

from keel.cli import main

if __name__ == "__main__":
    main()
