"""Refusing an untested release of a library whose internals we use (vLLM here, Ray in `deployment`)."""

import logging
import os

logger = logging.getLogger("specserve")


def refuse_untested(library: str, version: str, tested: str, internals_module: str, install: str) -> None:
    """Raise unless `version` starts with `tested`; SPECSERVE_ALLOW_UNTESTED_<LIBRARY>=1 makes it a warning."""
    if version.startswith(tested):
        return
    allow = f"SPECSERVE_ALLOW_UNTESTED_{library.upper()}"
    shown = f"{tested}x" if tested.endswith(".") else tested
    message = (f"specserve was tested with {library} {shown} and uses its internals ({internals_module}); "
               f"this is {library} {version}. Install {install}, or set {allow}=1 to try anyway.")
    if os.environ.get(allow) == "1":
        logger.warning(message)
        return
    raise RuntimeError(message)
