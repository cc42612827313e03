"""``python -m lightning_3d.plan``."""

from .app import main

if __name__ == "__main__":
    main()
