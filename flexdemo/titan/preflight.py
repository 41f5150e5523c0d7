"""``python -m flexdemo.titan.preflight CONFIG.toml [--section.key v ...]``: scripts/launch.sh's
one-process check before torchrun (flexdemo.titan.entry.preflight; ``main`` as before the regroup)."""

from .entry import preflight as main

if __name__ == "__main__":
    main()
