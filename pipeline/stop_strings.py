"""Stop-string matching with hold-back: the compiled ext/stop_strings.pyx when built, else its
pure-Python twin ext/stop_strings_py.py (same results; tests/ext/test_stop_strings_ext.py)."""
from __future__ import annotations

import ext

StopStringMatcher = ext.load("stop_strings").StopStringMatcher
