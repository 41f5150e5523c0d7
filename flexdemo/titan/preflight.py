"""``python -m flexdemo.titan.preflight CONFIG.toml [--section.key v ...]``: the launcher's one-process
check (flexdemo.titan.launch.plan) alone, printed as FD_NGPU / FD_NPROC / FD_ASSETS for a shell."""

from .launch import exit_after_success
from .launch import preflight_main as main

if __name__ == "__main__":
    exit_after_success(main().ngpu == 0)
