"""What megart export-hf and import-hf share: running the conversion and turning bad input
into one line on stderr and exit status 2."""

from __future__ import annotations

import sys
from collections.abc import Callable

from megart.errors import ConfigError


def run_conversion(prog: str, convert: Callable[[], str]) -> int:
    """Runs ``convert`` (which returns the line to print on success); a missing optional
    dependency, a ConfigError or an OSError is reported as ``prog: error: ...``, status 2."""
    try:
        done = convert()
    except ImportError as e:  # safetensors is an optional dependency
        print(f"{prog}: error: {e}; pip install 'megart[hf]'", file=sys.stderr)
        return 2
    except (ConfigError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    print(done)
    return 0
