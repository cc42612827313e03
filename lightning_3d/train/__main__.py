"""``python -m lightning_3d.train``: see ``lightning_3d.train.app``."""

from lightning_3d.train.app import main

if __name__ == "__main__":
    main()
