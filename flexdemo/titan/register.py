"""`[experimental] custom_import = "flexdemo.titan.register"`: registers the flexdemo specs
(flexdemo.titan.spec), and under torchtitan's own entry point first checks the run's config
(one line, exit 2).

Python imports a module once, so this happens once per process."""

from .entry import check_stock_entry_or_exit
from .spec import register_specs

check_stock_entry_or_exit()
register_specs()
