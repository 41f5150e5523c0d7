"""`[experimental] custom_import = "flexdemo.titan.register"`: registers the flexdemo specs.

Python imports a module once, so registration happens once per process."""

from torchtitan.protocols.train_spec import register_train_spec

from .train_spec import FAMILIES, family_spec

for _name, _family in FAMILIES.items():
    register_train_spec(_name, family_spec(_family))
