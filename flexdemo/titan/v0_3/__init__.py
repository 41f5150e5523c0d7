"""flexdemo's adapter for torchtitan 0.3.0 (imports torchtitan 0.3.0 only; flexdemo.titan.version
picks it or the 0.2.2 adapter once, from the installed torchtitan).

0.3.0 has no TOML configs and no TrainSpec: a run is a ``FlexTrainer.Config`` dataclass tree
(trainer.py), made from a flexdemo TOML (toml_config.py) or a registry function
(``--module flexdemo.titan.v0_3 --config cpu_2x2_flexdemo``: config_registry.py). What a mode
does is flexdemo.modes', the container around the optimizers flexdemo.titan.container's.
"""
