"""``python -m flexdemo.titan.preflight CONFIG.toml [--section.key v ...]``: scripts/launch.sh's
one-process check before torchrun (flexdemo.titan.entry.preflight)."""

from .entry import preflight

if __name__ == "__main__":
    preflight()
