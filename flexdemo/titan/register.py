"""`[experimental] custom_import = "flexdemo.titan.register"`: registers the flexdemo specs,
and under torchtitan's own entry point first checks the run's config (one line, exit 2).

Python imports a module once, so this happens once per process."""

from torchtitan.protocols.train_spec import register_train_spec

from .run import check_stock_entry_or_exit
from .train_spec import FAMILIES, family_spec

check_stock_entry_or_exit()

for _name, _family in FAMILIES.items():
    register_train_spec(_name, family_spec(_family))
