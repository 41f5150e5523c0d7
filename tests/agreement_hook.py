"""``--experimental.custom_import agreement_hook``: flexdemo's specs, with rank 1 reading the
payload format as one version newer, so that a launched job's replicas disagree (tests only)."""

import os

import flexdemo.titan.register  # noqa: F401  (the specs)

if os.environ.get("RANK") == "1":
    import flexdemo.wire.format as wire_format

    wire_format.WIRE_FORMAT_VERSION += 1
